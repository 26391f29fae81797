"""What the proxy checks before it listens: every failure a StartupError with a message (and a fix), never a trace."""

from __future__ import annotations

import logging

import pytest

from egress_proxy.front.startup import StartupError, file_stamps, load_policy, parse_connect_to, parse_resolve
from egress_proxy.edge.startup import check_rule_caps, open_custody, parse_response_caps
from tests.egress_proxy.builders import artifact, connection, rule


def test_resolve_entries_are_normalized_and_merged() -> None:
    assert parse_resolve(["API.GitHub.com.=140.82.112.6", "api.github.com=::1"]) == {"api.github.com": ("140.82.112.6", "::1")}


@pytest.mark.parametrize("entry", ["api.github.com", "=1.2.3.4", "api.github.com=", "api.github.com=not-an-ip", "*.x.com=1.2.3.4"])
def test_bad_resolve_entries(entry: str) -> None:
    with pytest.raises(StartupError, match="HOST=IP"):
        parse_resolve([entry])


def test_connect_to() -> None:
    assert parse_connect_to(["api.github.com:443:127.0.0.1:8443"]) == {("api.github.com", 443): ("127.0.0.1", 8443)}
    for bad in ("api.github.com:443:localhost:8443", "api.github.com:0:127.0.0.1:1", "a:b:c"):
        with pytest.raises(StartupError, match="HOST:PORT:ADDR:APORT"):
            parse_connect_to([bad])


def test_response_caps() -> None:
    assert parse_response_caps("1k", "", ["github/read=2k"]) == (1024, None, {"github/read": 2048})
    with pytest.raises(StartupError, match="not a size"):
        parse_response_caps("lots", "1g", [])
    with pytest.raises(StartupError, match="CONNECTION/RULE=SIZE"):
        parse_response_caps("1g", "1g", ["github=1k"])
    art = artifact(connections=[connection("github", [rule("read", "api.github.com")])])
    check_rule_caps({"github/read": 1}, art)
    with pytest.raises(StartupError, match="names no rule"):
        check_rule_caps({"github/write": 1}, art)


def test_a_missing_or_broken_artifact_is_refused_before_anything_else(tmp_path) -> None:
    with pytest.raises(StartupError, match="does not exist"):
        load_policy(str(tmp_path / "none.json"), str(tmp_path / "proof.json"), allow_unproven=False)
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(StartupError, match="artifact"):
        load_policy(str(tmp_path / "a.json"), str(tmp_path / "proof.json"), allow_unproven=True)


def test_an_unsigned_report_is_accepted_only_with_the_development_flag_and_then_logged(tmp_path, caplog) -> None:
    from tests.proxy_harness import make_env, unsigned

    env = make_env(tmp_path / "env")
    env.proof.write_text(unsigned(env.proof.read_text()))
    with pytest.raises(StartupError, match="is not signed"):
        load_policy(str(env.artifact), str(env.proof), allow_unproven=False)
    caplog.set_level(logging.WARNING, logger="egresslaw.proxy")
    assert load_policy(str(env.artifact), str(env.proof), allow_unproven=False, allow_unsigned=True).proved
    assert any("unsigned proof report (--allow-unsigned-proofs" in r.getMessage() for r in caplog.records)


def test_no_store_is_refused_with_the_fix(tmp_path) -> None:
    with pytest.raises(StartupError) as exc:
        open_custody("", str(tmp_path))
    assert "--store" in exc.value.message


def test_file_stamps(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    stamp, missing = file_stamps(str(tmp_path / "f"), str(tmp_path / "g"))
    assert stamp is not None and stamp[1] == 1 and missing is None
