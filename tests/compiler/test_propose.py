"""Denials -> the smallest policy change: what is proposed, what never is, and — the key property — the proposed
artifact admits every observed request through the real decision function while near misses stay denied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compiler.compile import compile_sources
from compiler.fmt import format_source
from compiler.parser import parse_source
from compiler.propose import (
    Denial,
    ProposeError,
    audit_files,
    propose,
    read_denials,
)
from egress_proxy.decision.adapter import decide
from egress_proxy.decision.types import Lease, Request

POLICY = """egresslaw 1

workspace "acme"
catalog "2026.11"

sandbox_profile "builder" {
  # builds the app
  trust = "trusted"
  provider = "gvisor@2026.10.1"
  network = {
    "type": "limited",
    "allowed_hosts": ["api.github.com"],
    "allow_package_managers": false,
    "allow_mcp_servers": false
  }
}

# GitHub, read-only for now
connection "github" {
  credential = "gh-prod"
  inject = {"header": "Authorization", "format": "Bearer {secret}"}

  egress "read-repos" {
    host = "api.github.com"
    path_prefix = "/repos/acme/app/pulls"
    methods = ["GET"]
    headers = ["accept"]
  }
}
"""
PUBLIC_IP = "93.184.216.34"
LEASE_CANARY = "el2.lk-0123456789abcdef.eyJzdWIiOiJjYW5hcnkifQ.CanaryMacValue0123456789"


def policy(text: str = POLICY):
    result = compile_sources({"p/policy.egress": text}, [])
    assert result.ok, result.diagnostics
    return result


def event(n: int, reason: str, *, connection: str | None = "github", profile: str | None = None, method: str = "GET",
          host: str = "api.github.com", port: int = 443, path: str | None = "/", scheme: str = "https", kind: str = "request",
          headers: list[str] | None = None, agent: str = "agent-7", decision: str = "deny") -> dict:
    e = {"v": "egresslaw.audit/1", "kind": kind, "id": f"ev{n:030d}", "decision": decision, "reason": reason,
         "subject": agent, "profile": profile, "connection": connection if profile is None else None, "method": method,
         "scheme": scheme, "host": host, "port": port, "path": path if kind == "request" else None, "rule": None}
    if headers is not None:
        e["headers"] = headers
    return e


def denials(events: list[dict]) -> list[Denial]:
    return [Denial(e["id"], "audit.jsonl", i, e["kind"], e["decision"], e["reason"], e) for i, e in enumerate(events, 1)]


def run(events: list[dict], text: str = POLICY):
    return propose(policy(text), denials(events))


def allowed(artifact, lease: Lease, method: str, url_host: str, port: int, path: str, scheme: str = "https",
            headers: tuple = ()) -> tuple[bool, str]:
    req = Request(method=method, scheme=scheme, host=url_host, port=port, target=path, headers=headers)
    d = decide(artifact, lease, req, [PUBLIC_IP])
    return d.allowed, d.reason


GITHUB = Lease(subject="agent-7", profile=None, connection="github", exp=0)
BUILDER = Lease(subject="agent-7", profile="builder", connection=None, exp=0)


# ---------------------------------------------------------------------------------------------
# Profiles: exact host:port entries
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "host, port, entry, near_miss",
    [
        ("pypi.org", 443, "pypi.org", ("pypi.org", 8443)),
        ("deb.debian.org", 80, "deb.debian.org:80", ("deb.debian.org", 443)),
        ("registry.npmjs.org", 8080, "registry.npmjs.org:8080", ("npmjs.org", 8080)),
    ],
)
def test_profile_denial_becomes_one_exact_entry(host, port, entry, near_miss):
    ev = [event(1, "profile-host-not-allowed", profile="builder", host=host, port=port, scheme="http" if port == 80 else "https"),
          event(2, "profile-host-not-allowed", profile="builder", host=host, port=port, kind="connect", agent="agent-9")]
    p = run(ev)
    assert [(c.kind, c.subject, c.add) for c in p.changes] == [("profile", "builder", {"allowed_hosts": [entry]})]
    assert p.changes[0].evidence.count == 2 and p.changes[0].evidence.subjects == ("agent-7", "agent-9")
    assert f'"api.github.com", "{entry}"' in p.new_sources["p/policy.egress"]
    assert "# builds the app" in p.new_sources["p/policy.egress"]  # comments survive the edit
    art = p.result.artifact
    scheme = "http" if port == 80 else "https"
    assert allowed(art, BUILDER, "GET", host, port, "/any/thing", scheme) == (True, "allowed")
    assert allowed(art, BUILDER, "GET", *near_miss, "/", scheme) == (False, "profile-host-not-allowed")
    # before: denied for the reason the log says
    assert allowed(policy().artifact, BUILDER, "GET", host, port, "/", scheme) == (False, "profile-host-not-allowed")


def test_profile_without_allowed_hosts_key_gets_one():
    text = POLICY.replace('    "allowed_hosts": ["api.github.com"],\n', "").replace(
        '"allow_package_managers": false', '"allow_package_managers": true')
    p = run([event(1, "profile-host-not-allowed", profile="builder", host="example.org")], text)
    assert p.changes[0].add == {"allowed_hosts": ["example.org"]}
    assert allowed(p.result.artifact, BUILDER, "GET", "example.org", 443, "/") == (True, "allowed")


def test_profile_with_no_network_is_not_proposable():
    head, rest = POLICY.split("  network = {", 1)
    text = head.replace('  trust = "trusted"\n', "") + '  network = {"type": "none"}\n}\n' + rest[rest.index("\n# GitHub"):]
    p = run([event(1, "profile-host-not-allowed", profile="builder", host="example.org")], text)
    assert p.changes == () and p.diff == ""
    (r,) = p.not_proposable
    assert r.reason == "profile-host-not-allowed" and "no network" in r.why


# ---------------------------------------------------------------------------------------------
# Connections: one exact rule per denied path, never a prefix
# ---------------------------------------------------------------------------------------------


def test_connection_denials_become_exact_rules_one_per_path():
    ev = [event(1, "path-not-allowed", path="/repos/acme/app/issues/1", headers=["accept", "user-agent"]),
          event(2, "path-not-allowed", path="/repos/acme/app/issues/2", headers=["accept", "user-agent"]),
          event(3, "path-not-allowed", path="/repos/acme/app/issues/1", method="HEAD", headers=["accept", "user-agent"], agent="agent-8")]
    p = run(ev)
    assert [(c.kind, c.subject, c.file) for c in p.changes] == [("connection", "github", "p/policy.egress")] * 2
    by_path = {c.add["egress"]["path"]: c for c in p.changes}
    assert by_path["/repos/acme/app/issues/1"].add == {"egress": {
        "name": "proposed-1", "host": "api.github.com", "port": 443, "path": "/repos/acme/app/issues/1",
        "methods": ["GET", "HEAD"], "headers": ["accept", "user-agent"]}}
    assert by_path["/repos/acme/app/issues/2"].add["egress"]["methods"] == ["GET"]  # the methods seen on that path only
    assert by_path["/repos/acme/app/issues/1"].evidence.subjects == ("agent-7", "agent-8")
    art = p.result.artifact
    assert [r.name for r in art.connection("github").rules] == ["read-repos", "proposed-1", "proposed-2"]  # appended
    for n, method in (("1", "GET"), ("2", "GET"), ("1", "HEAD")):
        assert allowed(art, GITHUB, method, "api.github.com", 443, f"/repos/acme/app/issues/{n}") == (True, "allowed")
    # near misses: a sibling, a method seen on another path, below the path, another host, another port
    assert allowed(art, GITHUB, "GET", "api.github.com", 443, "/repos/acme/app/issues/3")[0] is False
    assert allowed(art, GITHUB, "HEAD", "api.github.com", 443, "/repos/acme/app/issues/2")[0] is False
    assert allowed(art, GITHUB, "GET", "api.github.com", 443, "/repos/acme/app/issues/1/comments")[0] is False
    assert allowed(art, GITHUB, "GET", "api.github.com", 443, "/repos/acme/app/labels/1") == (False, "path-not-allowed")
    assert allowed(art, GITHUB, "GET", "uploads.github.com", 443, "/repos/acme/app/issues/1") == (False, "no-matching-rule")
    assert allowed(art, GITHUB, "GET", "api.github.com", 8443, "/repos/acme/app/issues/1") == (False, "no-matching-rule")
    assert allowed(art, GITHUB, "GET", "api.github.com", 443, "/repos/acme/app/pulls/3") == (True, "allowed")  # as before


def test_a_single_exact_path_stays_that_path():
    p = run([event(1, "path-not-allowed", path="/orgs/acme/teams", method="PUT")])
    rule = p.changes[0].add["egress"]
    assert (rule["host"], rule["port"], rule["path"], rule["methods"]) == ("api.github.com", 443, "/orgs/acme/teams", ["PUT"])
    assert "the events name no headers" in " ".join(p.changes[0].evidence.notes)
    art = p.result.artifact
    assert allowed(art, GITHUB, "PUT", "api.github.com", 443, "/orgs/acme/teams") == (True, "allowed")
    assert allowed(art, GITHUB, "PUT", "api.github.com", 443, "/orgs/acme/members") == (False, "path-not-allowed")
    assert allowed(art, GITHUB, "PUT", "api.github.com", 443, "/orgs/acme/teamsx") == (False, "path-not-allowed")
    assert allowed(art, GITHUB, "PUT", "api.github.com", 443, "/orgs/acme/teams/1")[0] is False  # nothing below it either
    assert allowed(art, GITHUB, "PUT", "api.github.com", 8443, "/orgs/acme/teams") == (False, "no-matching-rule")


def test_a_host_new_to_a_connection_is_never_proposed():
    """The agent chose the destination: a rule there would send the connection's credential to it."""
    p = run([event(1, "no-matching-rule", host="attacker.example.net", path="/collect", method="POST"),
             event(2, "no-matching-rule", host="api.github.com", port=8443, path="/repos/acme/app"),
             event(3, "no-matching-rule", kind="connect", host="attacker.example.net")])
    assert p.changes == () and p.diff == ""
    assert sum(r.evidence.count for r in p.not_proposable) == 3
    assert any("would send its credential" in r.why for r in p.not_proposable)


def test_long_hosts_make_rule_names_the_secret_scan_accepts():
    """`proposed-<host with dashes>` read as a high-entropy token for hosts like these (EL0029: nothing proposed)."""
    host = "objects.githubusercontent.com"
    text = POLICY.replace('host = "api.github.com"', f'host = "{host}"', 1)
    p = run([event(1, "path-not-allowed", host=host, path="/github-production-release-asset/1"),
             event(2, "profile-host-not-allowed", profile="builder", host="files.pythonhosted.org")], text)
    assert {c.kind for c in p.changes} == {"connection", "profile"} and p.result.ok
    assert [c.add["egress"]["name"] for c in p.changes if c.kind == "connection"] == ["proposed-1"]


def test_a_host_that_looks_like_a_secret_is_never_written():
    p = run([event(1, "profile-host-not-allowed", profile="builder", host="sk-abcdefghij12345678.example.com")])
    assert p.changes == () and "looks like it carries a secret" in p.not_proposable[0].why


def test_headers_the_language_refuses_are_dropped_and_said():
    sent = ["accept", "authorization", "content-type", "cookie", "host", "proxy-authorization", "x-forwarded-for", "x-request-id"]
    p = run([event(1, "path-not-allowed", path="/orgs/acme", method="POST", headers=sent)])
    (c,) = p.changes
    assert c.add["egress"]["headers"] == ["accept", "content-type", "x-request-id"]
    note = " ".join(c.evidence.notes)
    for dropped in ("authorization", "proxy-authorization", "x-forwarded-for", "cookie", "host"):
        assert f"`{dropped}`" in note
    # the proposal compiles, and the decision forwards the kept headers only
    req = Request("POST", "https", "api.github.com", 443, "/orgs/acme", headers=tuple((h, "api.github.com" if h == "host" else "v") for h in sent))
    d = decide(p.result.artifact, GITHUB, req, [PUBLIC_IP])
    assert d.allowed and [h for h, _ in d.forward_headers] == ["accept", "content-type", "x-request-id"]


def test_the_inject_header_of_the_connection_is_dropped_too():
    text = POLICY.replace('{"header": "Authorization", "format": "Bearer {secret}"}', '{"header": "X-Api-Key", "format": "{secret}"}')
    p = run([event(1, "path-not-allowed", path="/orgs/acme", headers=["accept", "x-api-key"])], text)
    assert p.changes[0].add["egress"]["headers"] == ["accept"]


def test_rule_names_stay_unique_in_the_connection():
    text = POLICY.replace('egress "read-repos"', 'egress "proposed-1"')
    p = run([event(1, "path-not-allowed", path="/orgs/acme")], text)
    assert [c.add["egress"]["name"] for c in p.changes] == ["proposed-2"]


def test_the_new_text_is_in_fmt_layout_and_the_rest_of_the_file_is_kept():
    p = run([event(1, "path-not-allowed", path="/orgs/acme")])
    new = p.new_sources["p/policy.egress"]
    tree, _ = parse_source(new, "p/policy.egress")
    assert format_source(tree) == new
    assert "# GitHub, read-only for now" in new
    assert p.diff.startswith("--- a/p/policy.egress\n+++ b/p/policy.egress\n")
    added = [line[1:] for line in p.diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert '  egress "proposed-1" {' in added and '    path = "/orgs/acme"' in added
    assert not [line for line in p.diff.splitlines() if line.startswith("-") and not line.startswith("---")]
    assert p.reformatted == []


def test_a_file_not_in_fmt_layout_is_said_to_be_reformatted():
    text = POLICY.replace('    methods = ["GET"]\n    headers = ["accept"]', '    methods: ["GET",]\n    headers = ["accept"]')
    p = run([event(1, "path-not-allowed", path="/orgs/acme")], text)
    assert p.reformatted == ["p/policy.egress"]
    assert '-    methods: ["GET",]' in p.diff


# ---------------------------------------------------------------------------------------------
# Never proposed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ev, reason, why",
    [
        (event(1, "scheme-not-allowed", scheme="http", port=80, path="/repos/acme/app"), "scheme-not-allowed", "https only"),
        (event(1, "path-not-allowed", scheme="http", port=80, path="/repos/acme/app"), "path-not-allowed", "https only"),
        (event(1, "lease-missing", connection=None, agent=None), "lease-missing", "lease problem"),
        (event(1, "lease-expired"), "lease-expired", "lease problem"),
        (event(1, "address-not-public", path="/x"), "address-not-public", "non-public"),
        (event(1, "address-denied", profile="builder"), "address-denied", "non-public"),
        (event(1, "smuggling"), "smuggling", "framing"),
        (event(1, "credential-unavailable"), "credential-unavailable", "custody"),
        (event(1, "path-dot-segment"), "path-dot-segment", "malformed"),
        (event(1, "no-matching-rule", kind="connect", host="uploads.github.com"), "no-matching-rule", "CONNECT names only"),
        (event(1, "method-not-allowed", method="TRACE", path="/repos/acme/app/pulls"), "method-not-allowed", "may name only"),
        (event(1, "path-not-allowed", connection="gitlab"), "path-not-allowed", "declares no connection"),
        (event(1, "no-matching-rule", host="metadata.google.internal"), "no-matching-rule", "special-use"),
        (event(1, "no-matching-rule", host="10.0.0.5"), "no-matching-rule", "IP literal"),
    ],
)
def test_not_proposable(ev, reason, why):
    p = run([ev, dict(ev, id="ev-second")])
    assert p.changes == () and p.diff == ""
    (r,) = p.not_proposable
    assert (r.reason, r.evidence.count) == (reason, 2)
    assert why in r.why


def test_an_event_copied_into_two_logs_counts_once(tmp_path):
    line = json.dumps(event(1, "path-not-allowed", path="/orgs/acme")) + "\n"
    for name in ("audit.jsonl", "copy.jsonl"):
        (tmp_path / name).write_text(line)
    p = propose(policy(POLICY), read_denials(sorted(tmp_path.glob("*.jsonl"))))
    assert p.changes[0].evidence.count == 1


def test_observe_mode_would_deny_is_evidence_too():
    p = run([event(1, "profile-host-not-allowed", profile="builder", host="pypi.org", decision="would-deny")])
    assert p.changes[0].add == {"allowed_hosts": ["pypi.org"]}


def test_a_denial_the_policy_already_admits_changes_nothing():
    p = run([event(1, "path-not-allowed", path="/repos/acme/app/pulls/9"),
             event(2, "profile-host-not-allowed", profile="builder", host="api.github.com")])
    assert p.changes == () and p.not_proposable == () and p.admitted.count == 2 and p.diff == ""


def test_no_secret_or_lease_is_ever_echoed():
    ev = [event(1, "path-not-allowed", path="/hooks/ghp_CanaryToken0123456789abcdefABCDEF/run"),
          event(2, "path-not-allowed", path="/orgs/acme", agent=LEASE_CANARY, headers=["accept", LEASE_CANARY.lower()]),
          dict(event(3, "lease-invalid"), auth="bearer", id=LEASE_CANARY)]
    p = run(ev)
    blob = json.dumps(p.to_dict("p")) + p.diff + "".join(p.new_sources.values())
    for needle in ("ghp_CanaryToken", LEASE_CANARY, LEASE_CANARY.lower(), "CanaryMacValue".lower()):
        assert needle not in blob
    assert "[redacted]" in blob
    assert any("looks like it carries a secret" in r.why for r in p.not_proposable)


# ---------------------------------------------------------------------------------------------
# Reading the evidence
# ---------------------------------------------------------------------------------------------


def test_reading_a_log_keeps_denials_only(tmp_path: Path):
    lines = [{"v": "egresslaw.audit/1", "kind": "audit-open", "decision": "info", "reason": "new"},
             dict(event(1, "allowed"), decision="allow"), event(2, "path-not-allowed"),
             {"kind": "outcome", "of": "request", "id": "x", "decision": "allow", "reason": "allowed"},
             event(3, "profile-host-not-allowed", profile="builder", decision="would-deny")]
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (tmp_path / "audit.jsonl.000001").write_text(json.dumps(event(4, "lease-missing")) + "\n")
    (tmp_path / "notes.txt").write_text("not a log\n")
    files = audit_files(tmp_path)
    assert [f.name for f in files] == ["audit.jsonl.000001", "audit.jsonl"]
    got = read_denials(files)
    assert [(d.id, d.line, d.decision) for d in got] == [
        (f"ev{4:030d}", 1, "deny"), (f"ev{2:030d}", 3, "deny"), (f"ev{3:030d}", 5, "would-deny")]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"kind": "request"}\n{not json\n', "line 2 is not a JSON event"),
        ("[1, 2]\n", "line 1 is not a JSON object"),
        ('{"kind": "request", "decision": "deny", "id": "x"}\n', "without a `reason`"),
        (b"\xff\xfe\n", "line 1 is not a JSON event"),
    ],
)
def test_a_malformed_line_is_refused_naming_file_and_line(tmp_path: Path, content, message):
    log = tmp_path / "audit.jsonl"
    log.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProposeError) as exc:
        read_denials([log])
    assert message in exc.value.message and str(log) in exc.value.message


def test_a_proposable_event_with_a_wrong_field_is_refused():
    bad = event(1, "path-not-allowed", path=None)
    with pytest.raises(ProposeError, match="`path` is not a str"):
        run([bad])
    both = event(2, "path-not-allowed")
    both["profile"] = "builder"
    with pytest.raises(ProposeError, match="exactly one profile or connection"):
        run([both])


@pytest.mark.parametrize("make, message", [(lambda p: p / "missing", "does not exist"), (lambda p: p, "holds no audit log")])
def test_a_missing_or_empty_directory_is_refused(tmp_path: Path, make, message):
    with pytest.raises(ProposeError, match=message):
        audit_files(make(tmp_path))
