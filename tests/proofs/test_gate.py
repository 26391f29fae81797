"""The start gate: a valid signature by the trusted key (unsigned only with --allow-unsigned-proofs), a summary that
agrees with the results, every required check, the same egresslaw and decision code.

Unit tests of `proofs.gate.check_report`, then the real `egresslaw proxy` refusing to start (exit 2, nothing
listening) on a partial, foreign, unsigned, wrongly signed, tampered, edited or stale report.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from egress_proxy.decision.provenance import core_digest, egresslaw_version
from egresslaw.cli import main
from proofs.gate import GateError, check_report, required_checks
from proofs.report import load_report
from proofs.signing import (
    SigningError,
    init_signing_keys,
    load_private_key,
    load_public_key,
    sign_document,
    verify_document,
)
from tests.proofs.helpers import artifact, connection, github, profile, rule, worker
from tests.proxy_harness import build_artifact, free_port, make_env, proof_for, unsigned

ROOT = Path(__file__).resolve().parents[2]
ART = build_artifact()


def _doc() -> dict:
    """The honest report of ART, unsigned."""
    return json.loads(unsigned(proof_for(ART)))


def _text(doc: dict) -> str:
    """A report edited as a careful forger would: its summary made to agree with its results."""
    counts = {v: sum(r["verdict"] == v for r in doc["results"]) for v in ("proved", "refuted", "unknown")}
    return json.dumps(dict(doc, summary={"total": len(doc["results"]), **counts}))


def _dev(text: str, art=ART, **kw):
    return check_report(text, art, allow_unsigned=True, **kw)


def test_required_checks_come_from_the_artifact():
    art = artifact(connections=[github("edge"), connection("hooks", [rule("r", "hooks.example.org")], worker="ghost")],
                   profiles=[profile("ci", [("pypi.org", 443)])], workers=[worker("edge")])
    req = required_checks(art)
    assert ("edge", "worker:edge", "deny-cidrs") in req and ("default", "worker:default", "no-redirect") in req
    assert {p for w, s, p in req if s == "connection:github"} == {
        "vacuity", "public-only", "deny-cidrs", "no-redirect", "worker-switches", "header-safety", "credential-scope",
        "dns-confined"}
    assert {p for w, s, p in req if s == "profile:ci"} == {
        "vacuity", "public-only", "deny-cidrs", "no-redirect", "worker-switches", "header-safety", "profile-scope", "trust-lane",
        "dns-confined"}
    assert ("ghost", "connection:hooks", "vacuity") in req  # an orphan: its (refuted) vacuity is required
    assert len(req) == 4 + 4 + 8 + 9 + 1


def test_a_complete_report_passes_and_every_gap_is_refused():
    report = _dev(_text(_doc()))
    assert {r.key for r in report.results} == required_checks(ART)
    doc = _doc()
    dropped = doc["results"].pop(3)
    with pytest.raises(GateError, match="lacks 1 required check") as exc:
        _dev(_text(doc))
    assert f"{dropped['property']} for {dropped['subject']}" in exc.value.message
    doc = _doc()
    doc["results"] = [r for r in doc["results"] if r["property"] == "no-redirect"]  # the cut-down report of issue 11
    with pytest.raises(GateError, match=r"lacks \d+ required checks"):
        _dev(_text(doc))
    doc = _doc()
    doc["results"][0]["verdict"] = "unknown"
    with pytest.raises(GateError, match="does not prove"):
        _dev(_text(doc))
    other = build_artifact([rule("new", "api.acme-test.dev", "/new")])
    with pytest.raises(GateError, match="is about artifact"):
        _dev(_text(_doc()), other)


def test_a_summary_that_disagrees_with_the_results_is_refused():
    """An `unknown` edited to `proved` in the results, the summary left as the prover wrote it."""
    doc = _doc()
    doc["results"][0]["verdict"] = "unknown"
    doc = json.loads(_text(doc))  # the prover's summary of that report: 1 unknown
    doc["results"][0]["verdict"] = "proved"
    with pytest.raises(GateError, match="disagrees with its results") as exc:
        _dev(json.dumps(doc))
    assert '"unknown": 1' in exc.value.message


def test_a_check_listed_twice_is_refused():
    """A refuted check with a `proved` copy beside it (the summary made consistent): the copy must not hide it."""
    doc = _doc()
    doc["results"].append(dict(doc["results"][0], verdict="refuted"))
    with pytest.raises(GateError, match="lists 1 check more than once") as exc:
        _dev(_text(doc))
    assert doc["results"][0]["subject"] in exc.value.message


def test_unsigned_reports_need_the_development_flag_and_signed_ones_a_trusted_key(tmp_path):
    with pytest.raises(GateError, match="is not signed: production start-up requires") as exc:
        check_report(_text(_doc()), ART)
    assert "--allow-unsigned-proofs" in (exc.value.help or "")
    with pytest.raises(GateError, match="no key is trusted"):
        check_report(proof_for(ART), ART)  # signed, yet nothing to check the signature with
    with pytest.raises(GateError, match="no key is trusted"):
        check_report(proof_for(ART), ART, allow_unsigned=True)  # a signature present is always checked


@pytest.mark.parametrize(("field", "value"), [("egresslaw_version", "0.0.9"), ("core_digest", "0" * 64)])
def test_a_report_from_another_egresslaw_or_core_is_refused(field, value):
    doc = _doc()
    doc[field] = value
    with pytest.raises(GateError, match="was made by egresslaw") as exc:
        _dev(_text(doc))
    assert egresslaw_version() in exc.value.message and core_digest()[:12] in exc.value.message


def test_signatures(tmp_path):
    priv_path, pub_path = init_signing_keys(tmp_path / "keys")
    assert os.stat(priv_path).st_mode & 0o777 == 0o600
    other_priv, other_pub = init_signing_keys(tmp_path / "other")
    key = load_private_key(priv_path)
    doc = _doc()
    doc["signature"] = sign_document(doc, key)
    verify_document(doc, load_public_key(pub_path))
    assert check_report(json.dumps(doc), ART, trusted_key=str(pub_path)).signature == doc["signature"]
    with pytest.raises(GateError, match="not signed"):
        check_report(_text(_doc()), ART, trusted_key=str(pub_path))
    with pytest.raises(GateError, match="not by the trusted key"):
        check_report(json.dumps(doc), ART, trusted_key=str(other_pub))
    tampered = json.loads(json.dumps(doc))
    tampered["results"][0]["time_ms"] += 1
    with pytest.raises(GateError, match="changed after signing"):
        check_report(_text(tampered), ART, trusted_key=str(pub_path))
    os.chmod(priv_path, 0o644)
    with pytest.raises(SigningError, match="accessible by group or others"):
        load_private_key(priv_path)
    with pytest.raises(SigningError, match="already exists"):
        init_signing_keys(tmp_path / "keys")


def test_cli_signs_and_refuses_without_the_key(tmp_path, capsys):
    assert main(["keys", "init", "--proof-signing", "--dir", str(tmp_path / "pk")]) == 0
    assert "--trust-proofs" in capsys.readouterr().out
    art_path = tmp_path / "a.json"
    art_path.write_text(artifact(connections=[github()]).to_json())
    out = tmp_path / "proof.json"
    assert main(["prove", str(art_path), "-o", str(out), "--sign", str(tmp_path / "pk" / "proof-signing.key")]) == 0
    signed = load_report(out.read_text())
    assert signed.signature and signed.signature["alg"] == "ed25519"
    check_report(out.read_text(), artifact(connections=[github()]), trusted_key=str(tmp_path / "pk" / "proof-signing.pub"))
    assert main(["prove", str(art_path), "-o", "", "--sign", str(tmp_path / "missing.key")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_version_shows_the_core_digest(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"egresslaw {egresslaw_version()} (decision core {core_digest()})"


# -- the real proxy ----------------------------------------------------------------------------------


def _proxy(env, port: int, admin: int, proof: Path, *extra: str, environ=None, runner=("-m", "egresslaw")):
    """`egresslaw proxy` (or, with `runner`, the CLI under a mutant: `tests.proofs.mutants run`) on `proof`."""
    args = ["proxy", "--artifact", str(env.artifact), "--proof", str(proof), "--keys", str(env.keys), "--store",
            str(env.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", "--confdir",
            str(env.confdir), "--audit-log", str(env.audit), *extra]
    return subprocess.run([sys.executable, *runner, *args], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=environ)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_the_proxy_refuses_partial_foreign_unsigned_tampered_edited_and_stale_reports(tmp_path):
    env = make_env(tmp_path / "env")
    priv, pub = init_signing_keys(tmp_path / "pk")
    _, other_pub = init_signing_keys(tmp_path / "other")
    doc = json.loads(unsigned(env.proof.read_text()))
    key = load_private_key(priv)

    def sign(d: dict) -> dict:
        return dict(d, signature=sign_document(d, key))

    signed = sign(doc)
    first = doc["results"][0]
    partial = sign(json.loads(_text(dict(doc, results=doc["results"][1:]))))
    foreign = sign(dict(doc, egresslaw_version="0.0.9"))
    tampered = json.loads(json.dumps(signed))
    tampered["results"][0]["detail"] = "edited"
    # an `unknown` edited to `proved` in an unsigned report (the prover's summary kept): refused even in development
    edited = json.loads(_text(dict(doc, results=[dict(first, verdict="unknown"), *doc["results"][1:]])))
    edited["results"][0]["verdict"] = "proved"
    # another core's report with its digest rewritten to this one's: only a signature can tell, so unsigned is refused
    rewritten = dict(doc, core_digest=core_digest())
    files = {}
    for name, d in {"partial": partial, "foreign": foreign, "signed": signed, "tampered": tampered, "edited": edited,
                    "rewritten": rewritten}.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(d))
    trusted = ("--trust-proofs", str(pub))
    cases = {
        "partial": (files["partial"], trusted, f"lacks 1 required check: {first['property']} for {first['subject']}"),
        "foreign": (files["foreign"], trusted, "was made by egresslaw 0.0.9"),
        "unsigned": (files["rewritten"], (), "is not signed: production start-up requires a report signed by a trusted key"),
        "unsigned-trusted": (files["rewritten"], trusted, "the report is not signed"),
        "signed-no-key": (files["signed"], (), "no key is trusted to check the signature"),
        "signed-dev": (files["signed"], ("--allow-unsigned-proofs",), "no key is trusted to check the signature"),
        "edited": (files["edited"], ("--allow-unsigned-proofs",), "disagrees with its results"),
        "wrong-key": (files["signed"], ("--trust-proofs", str(other_pub)), "not by the trusted key"),
        "tampered": (files["tampered"], trusted, "changed after signing"),
    }
    port, admin = free_port(), free_port()
    no_env_key = {k: v for k, v in os.environ.items() if k != "EGRESSLAW_TRUST_PROOFS"}
    for name, (proof, extra, message) in cases.items():
        r = _proxy(env, port, admin, proof, *extra, environ=no_env_key)
        assert r.returncode == 2, (name, r.stderr)
        assert message in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr
        assert not _listening(port) and not _listening(admin), name
    # stale: the honest signed report, and a proxy whose decision code changed outside the core (the adapter's
    # composition, the normalizer that builds the rule table): the digest covers them, so the proxy refuses it
    for mutant in ("profile-answers-skipped", "normalize-prefix-drops-last-segment"):
        r = _proxy(env, port, admin, files["signed"], *trusted, environ=no_env_key, runner=("-m", "tests.proofs.mutants", "run", mutant))
        assert r.returncode == 2, (mutant, r.stderr)
        assert "was made by egresslaw" in r.stderr and "decision code" in r.stderr, (mutant, r.stderr)
        assert not _listening(port), mutant
    # the same signed report, with its own key, starts the proxy
    proc = subprocess.Popen([sys.executable, "-m", "egresslaw", *[
        "proxy", "--artifact", str(env.artifact), "--proof", str(files["signed"]), "--keys", str(env.keys), "--store",
        str(env.store), "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}", "--confdir", str(env.confdir),
        "--audit-log", str(env.audit), "--trust-proofs", str(pub)]], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        import time

        deadline = time.monotonic() + 30
        while not _listening(port) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert _listening(port), proc.stderr.read() if proc.poll() is not None else "not listening"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
