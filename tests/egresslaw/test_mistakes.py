"""Mistakes caught early: a typo'd connection or handle is refused before anything is sealed, a proxy whose
credential is missing does not start, misspelled options and commands get a did-you-mean, every command reads the
EGRESSLAW_* settings the proxy reads, and a refused CONNECT names its reason where curl shows it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.proxy_harness import CANARY, assert_no_canary, free_port, make_env

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSLAW_") or k == "EGRESSLAW_TRUST_PROOFS"}
    return subprocess.run([sys.executable, "-m", "egresslaw", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})}, input=input)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mistakes")
    art = root / "egresslaw.json"
    assert _cli("compile", "policies/demo", "-o", str(art)).returncode == 0
    assert _cli("keys", "init", "--dir", str(root / "keys")).returncode == 0
    return {"EGRESSLAW_KEYS": str(root / "keys"), "EGRESSLAW_STORE": str(root / "custody.db"), "EGRESSLAW_ARTIFACT": str(art)}


def test_custody_put_refuses_what_the_artifact_does_not_have_and_seals_nothing(demo):
    cases = {
        ("--connection", "gihtub"): ("has no connection `gihtub`", "did you mean `github`?"),
        ("--connection", "github", "--handle", "gh-prd"): ("reads its credential from handle `gh-prod`, not `gh-prd`", "--handle gh-prod"),
        ("--connection", "github", "--workspace", "acmee"): ("is for workspace `acme`, not `acmee`", "--workspace acme"),
        ("--connection", "release-bot"): ("is `github_app`: a single static value would not fit it", "--kind github_app"),
        ("--connection", "github", "--kind", "oauth2", "--field", "client_id=x"): ("is `static`, not `oauth2`", "--kind static"),
    }
    for argv, (message, fix) in cases.items():
        r = _cli("custody", "put", *argv, env=demo, input=CANARY)
        assert r.returncode == 2, (argv, r.stderr)
        assert message in r.stderr and fix in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert_no_canary(r.stdout + r.stderr, "custody put refusal")
    assert not Path(demo["EGRESSLAW_STORE"]).exists()  # refused before the store was created
    # The right connection alone: workspace and handle come from the artifact, keys and store from EGRESSLAW_*.
    ok = _cli("custody", "put", "--connection", "github", env=demo, input=CANARY)
    assert ok.returncode == 0 and "sealed `acme/github/gh-prod`" in ok.stdout, ok.stderr
    listed = _cli("custody", "list", "--format", "json", env=demo)
    assert listed.returncode == 0 and '"handle": "gh-prod"' in listed.stdout, listed.stderr
    lease = _cli("lease", "--connection", "gihtub", env=demo)
    assert lease.returncode == 2 and "did you mean `github`?" in lease.stderr


def test_keys_and_ca_read_the_same_environment(tmp_path):
    keys, conf = tmp_path / "keys", tmp_path / "conf"
    r = _cli("keys", "init", env={"EGRESSLAW_KEYS": str(keys)})
    assert r.returncode == 0 and (keys / "lease.key").is_file(), r.stderr
    r = _cli("ca", env={"EGRESSLAW_CONFDIR": str(conf)})
    assert r.returncode == 0 and r.stdout.strip().startswith(str(conf)), r.stderr
    r = _cli("keys", "init", "--dir", str(tmp_path / "flag"), env={"EGRESSLAW_KEYS": str(keys)})  # a flag wins
    assert r.returncode == 0 and (tmp_path / "flag" / "lease.key").is_file()


def test_misspellings_get_a_did_you_mean(demo):
    r = _cli("compile", "policies/demo", "--fromat", "json")
    assert r.returncode == 2 and "`--fromat`: did you mean `--format`?" in r.stderr, r.stderr
    r = _cli("proxi")
    assert r.returncode == 2 and "did you mean `proxy`?" in r.stderr, r.stderr
    r = _cli("custody", "list", "--fromat=json", env=demo)
    assert r.returncode == 2 and "did you mean `--format`?" in r.stderr and "json" not in r.stderr.split("did you mean")[0].split("error:")[1]


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_proxy_whose_credential_is_missing_exits_2_naming_the_address(tmp_path, workers):
    e = make_env(tmp_path / "env")  # seals acme/github/gh-prod
    from egress_proxy.custody.stores import open_store

    with open_store(e.store, e.keys, create=False) as store:
        store.delete(next(iter(store.list())).address)
        from egress_proxy.custody.records import Address

        store.put(Address("acme", "github", "gh-prd"), b"typo")  # the same connection under a typo'd handle
    port = free_port()
    r = _cli("proxy", "--artifact", str(e.artifact), "--proof", str(e.proof), "--keys", str(e.keys), "--store", str(e.store),
             "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{free_port()}", "--confdir", str(e.confdir),
             "--audit-log", str(e.audit), "--workers", workers)
    assert r.returncode == 2, r.stderr
    assert "connection `github` has no credential in custody: nothing is sealed at `acme/github/gh-prod`" in r.stderr, r.stderr
    assert "the store holds `acme/github/gh-prd` for it: is the handle a typo?" in r.stderr
    assert "custody put" in r.stderr and "Traceback" not in r.stderr and "listening on" not in r.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_a_refused_connect_names_its_reason_in_the_status_line_curl_shows(tmp_path):
    from tests.proxy_harness import FleetProcess

    e = make_env(tmp_path / "env")
    fleet = FleetProcess(e, ["--resolve", "api.acme-test.dev=93.184.216.34"], workers=1)
    try:
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
        r = subprocess.run(["curl", "-sS", "-v", "-x", f"http://127.0.0.1:{fleet.port}", "https://api.acme-test.dev/"],
                           capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode != 0
        assert "< HTTP/1.1 407 Proxy Authentication Required (egresslaw: lease-missing)" in r.stderr, r.stderr
        assert "X-Egresslaw-Deny: lease-missing" in r.stderr
    finally:
        fleet.stop()


def test_a_file_the_command_may_not_read_is_named_with_its_fix_in_text_and_json(monkeypatch, capsys):
    """Keys made by another user (the container recipe's first trap): the path, the uid and a chown, never a traceback
    or `internal error`; in JSON logging mode one JSON object, like every other line the proxy writes."""
    import argparse
    import json

    from egresslaw import cli

    def boom(args):
        raise PermissionError(13, "Permission denied", "/etc/egresslaw/keys/lease.key")

    class FakeParser:
        def parse_known_args(self, argv):
            return argparse.Namespace(run=boom, log_format=argv[0]), []

    monkeypatch.setattr(cli, "build_parser", FakeParser)
    assert cli.main(["text"]) == 2
    text = capsys.readouterr().err
    assert f"error: permission denied on `/etc/egresslaw/keys/lease.key` (this command runs as uid {os.getuid()})" in text
    assert f"help: make it readable" in text and f"chown -R {os.getuid()} /etc/egresslaw/keys" in text
    assert cli.main(["json"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    doc = json.loads(line)
    assert doc["level"] == "error" and "/etc/egresslaw/keys/lease.key" in doc["message"] and "chown" in doc["help"]
