"""`egresslaw lane --check-only DIR`: the configuration written and read back in CI, without starting Envoy."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.egress_proxy import builders as b
from tests.proxy_harness import make_env, proof_signing_key


def test_check_only_writes_the_configuration_and_names_what_each_profile_reaches(tmp_path):
    art = b.artifact(connections=[b.connection("gh", [b.rule("read", "api.example.dev", "/", ["GET"])], credential="h")],
                     profiles=[b.profile("ci", [("pypi.org", 443), ("deb.debian.org", 80)]), b.profile("agent", [("pypi.org", 443)], brokers=["gh"])])
    env = make_env(tmp_path / "env", art)
    out = tmp_path / "envoy"
    done = subprocess.run([sys.executable, "-m", "egresslaw", "lane", "--artifact", str(env.artifact), "--proof", str(env.proof),
                           "--trust-proofs", str(proof_signing_key()[1]), "--keys", str(env.keys), "--confdir", str(tmp_path / "conf"),
                           "--check-only", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lane serves profile `ci`: deb.debian.org:80, pypi.org:443" in done.stdout
    assert "profile `agent` stays on the mitmproxy edge: it brokers connections" in done.stdout
    assert "translation check: exact" in done.stdout
    lds = json.loads((out / "xds" / "lds.json").read_text())
    assert {x["name"] for x in lds["resources"]} == {"front", "mitm|ci|pypi.org:443", "mitm|ci|deb.debian.org:80"}
    assert sorted(p.name for p in (out / "certs").glob("*.pem")) == ["deb.debian.org.pem", "pypi.org.pem"]


def test_a_tampered_artifact_never_reaches_envoy(tmp_path):
    env = make_env(tmp_path / "env", b.artifact(profiles=[b.profile("ci", [("pypi.org", 443)])]))
    env.artifact.write_text(env.artifact.read_text().replace("pypi.org", "evil.example"))
    done = subprocess.run([sys.executable, "-m", "egresslaw", "lane", "--artifact", str(env.artifact), "--proof", str(env.proof),
                           "--trust-proofs", str(proof_signing_key()[1]), "--keys", str(env.keys), "--confdir", str(tmp_path / "conf"),
                           "--check-only", str(tmp_path / "envoy")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert not (tmp_path / "envoy").exists()
