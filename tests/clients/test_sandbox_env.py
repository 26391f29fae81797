"""`egresslaw sandbox-env`: every variable, every format, the CA bundle and wgetrc, and the lease printed nowhere but stdout."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from egresslaw.commands.sandbox_env import CA_VARIABLES, environment, wgetrc_path
from tests.egress_proxy import builders as b

EGRESSLAW = str(Path(sys.executable).with_name("egresslaw"))
ISSUE_VARIABLES = {
    "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
    "NODE_EXTRA_CA_CERTS", "npm_config_https_proxy", "npm_config_proxy", "npm_config_cafile", "GIT_SSL_CAINFO",
    "CARGO_HTTP_CAINFO", "CARGO_HTTP_PROXY",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sbenv")
    subprocess.run([EGRESSLAW, "keys", "init", "--dir", str(root / "keys")], check=True, capture_output=True)
    art = b.artifact(
        connections=[b.connection("github", [b.rule("read", "api.github.com", "/repos", ["GET"])], credential="gh")],
        profiles=[b.profile("package-builder", [("pypi.org", 443)])],
    )
    (root / "egresslaw.json").write_text(art.to_json())
    lease = subprocess.run([EGRESSLAW, "lease", "--keys", str(root / "keys"), "--artifact", str(root / "egresslaw.json"), "--profile", "package-builder",
                            "--subject", "sb-1"],
                           check=True, capture_output=True, text=True).stdout.strip()
    (root / "lease.txt").write_text(lease + "\n")
    ca = subprocess.run([EGRESSLAW, "ca", "--confdir", str(root / "conf")], check=True, capture_output=True, text=True).stdout.strip()
    return {"root": root, "lease": lease, "ca": ca}


def _run(setup, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`egresslaw sandbox-env` in-process (the CLI's own main), stdout and stderr captured."""
    import contextlib
    import io

    from egresslaw.cli import main

    cmd = ["sandbox-env", "--proxy", "10.0.0.2:8080", "--bundle", str(setup["root"] / "out" / "ca.pem"), *args]
    out, err, old = io.StringIO(), io.StringIO(), sys.stdin
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(cmd)
    finally:
        sys.stdin = old
    return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())


def test_every_variable_the_issue_lists_and_one_bundle_for_every_client(setup):
    done = _run(setup, "--lease-file", str(setup["root"] / "lease.txt"), "--ca", setup["ca"], "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    env, lease = doc["env"], setup["lease"]
    assert ISSUE_VARIABLES <= set(env)
    url = f"http://egresslaw:{lease}@10.0.0.2:8080"
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "npm_config_https_proxy", "npm_config_proxy", "CARGO_HTTP_PROXY"):
        assert env[name] == url
    bundle = str(setup["root"] / "out" / "ca.pem")
    assert {env[name] for name in CA_VARIABLES} == {bundle} and doc["ca_bundle"] == bundle
    assert doc["apt_conf"] == f'Acquire::http::Proxy "{url}/";\nAcquire::https::Proxy "{url}/";\nAcquire::https::CAInfo "{bundle}";\n'
    text = Path(bundle).read_text()
    assert Path(setup["ca"]).read_text().strip() in text  # the proxy CA ...
    assert text.count("BEGIN CERTIFICATE") > 10 and "PRIVATE KEY" not in text  # ... after the system roots, no key
    assert stat.S_IMODE(os.stat(bundle).st_mode) == 0o644
    assert env["WGETRC"] == doc["wgetrc"] == bundle + ".wgetrc" and Path(env["WGETRC"]).is_file()
    assert env["YARN_DISABLE_SELF_UPDATE_CHECK"] == "true"


def test_the_formats_say_the_same_thing(setup):
    args = ("--lease-file", str(setup["root"] / "lease.txt"), "--ca", setup["ca"], "--bundle-path", "/etc/egresslaw/ca bundle.pem")
    env = json.loads(_run(setup, *args, "--format", "json").stdout)["env"]
    exports = _run(setup, *args).stdout
    assert exports.startswith("# egresslaw sandbox environment: profile `package-builder`, subject `sb-1`, lease expires ")
    shell = subprocess.run(["bash", "-c", exports + "\nenv -0"], capture_output=True, env={"PATH": os.environ["PATH"]}, check=True).stdout
    sourced = dict(item.split("=", 1) for item in shell.decode().split("\0") if "=" in item)
    assert {k: sourced[k] for k in env} == env
    dotenv = _run(setup, *args, "--format", "dotenv").stdout.splitlines()
    assert dotenv[0].startswith("# ") and dict(line.split("=", 1) for line in dotenv[1:]) == env
    apt = _run(setup, *args, "--format", "apt").stdout
    assert apt == json.loads(_run(setup, *args, "--format", "json").stdout)["apt_conf"]


def test_the_lease_can_come_from_stdin_or_be_minted_here(setup):
    piped = _run(setup, "--lease-file", "-", "--ca", setup["ca"], "--format", "json", stdin=setup["lease"])
    assert json.loads(piped.stdout)["env"]["HTTPS_PROXY"].endswith(f"{setup['lease']}@10.0.0.2:8080")
    root = setup["root"]
    minted = _run(setup, "--keys", str(root / "keys"), "--connection", "github", "--artifact", str(root / "egresslaw.json"),
                  "--subject", "sb-2", "--confdir", str(root / "conf"), "--format", "json")
    assert minted.returncode == 0, minted.stderr
    token = json.loads(minted.stdout)["env"]["HTTPS_PROXY"].split(":", 2)[2].split("@")[0]
    from egress_proxy.custody.keys import load_lease_keys
    from egress_proxy.custody.lease import verify

    got = verify(load_lease_keys(root / "keys"), token, now=__import__("time").time())
    assert (got.subject, got.connection) == ("sb-2", "github")


@pytest.mark.parametrize(("proxy", "url_end"), [("[fd00::2]:8080", "@[fd00::2]:8080"), ("fd00::2:8080", "@[fd00::2]:8080"), ("http://proxy.internal:3128/", "@proxy.internal:3128")])
def test_proxy_address_forms(setup, proxy, url_end):
    done = _run(setup, "--proxy", proxy, "--lease-file", str(setup["root"] / "lease.txt"), "--ca", setup["ca"], "--format", "json")
    assert json.loads(done.stdout)["env"]["HTTPS_PROXY"].endswith(url_end)


def _wgetrc_settings(text: str) -> dict[str, str]:
    """A wgetrc as wget reads it: `name = value` lines (value trimmed, to the end of the line), `#` lines ignored."""
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in text.splitlines() if line.strip() and not line.startswith("#"))}


def test_wget_gets_a_wgetrc_beside_the_bundle_that_names_the_bundle_as_the_sandbox_sees_it(setup):
    host = setup["root"] / "wget" / "ca.pem"
    inside = "/etc/egresslaw/ca bundle.pem"
    done = _run(setup, "--lease-file", str(setup["root"] / "lease.txt"), "--ca", setup["ca"], "--bundle", str(host),
                "--bundle-path", inside, "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    # the host file is written beside --bundle; the sandbox finds it beside --bundle-path, where WGETRC points
    assert doc["env"]["WGETRC"] == doc["wgetrc"] == inside + ".wgetrc"
    written = host.with_name("ca.pem.wgetrc")
    assert _wgetrc_settings(written.read_text()) == {"ca_certificate": inside, "use_proxy": "on"}
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o644
    # no `.wgetrc` (wget would read one in HOME even without WGETRC) and no leftover temporary file
    assert sorted(p.name for p in host.parent.iterdir()) == ["ca.pem", "ca.pem.wgetrc"]
    lease = setup["lease"]
    for path in (host, written):  # the lease rides in https_proxy only, never in a file on the host
        assert lease not in path.read_text() and lease.split(".")[2] not in path.read_text()


def test_the_library_adds_wgetrc_only_when_asked():
    """`sandbox-run` imports these: the positional signature still works, and WGETRC never names a file nobody wrote."""
    url, bundle = "http://egresslaw:x@10.0.0.2:8080", "/etc/egresslaw/ca.pem"
    plain = environment(url, bundle, "localhost")
    assert "WGETRC" not in plain and {plain[name] for name in CA_VARIABLES} == {bundle}
    with_rc = environment(url, bundle, "localhost", wgetrc=wgetrc_path(bundle))
    assert with_rc == {**plain, "WGETRC": "/etc/egresslaw/ca.pem.wgetrc"}


def _blocked_wgetrc(root: Path) -> str:
    """A bundle path whose wgetrc path is taken by a directory."""
    (root / "blocked" / "ca.pem.wgetrc").mkdir(parents=True, exist_ok=True)
    return str(root / "blocked" / "ca.pem")


def _bad_cert(root: Path, kind: str) -> str:
    conf = root / "conf"
    if kind == "key":
        return str(conf / "mitmproxy-ca.pem")  # mitmproxy's CA file: certificate AND private key
    if kind == "leaf":
        from tests.proxy_harness import _issue

        return str(_issue(root / "leafpki", ("x.acme-test.dev",)).cert_pem)
    path = root / f"{kind}.pem"
    path.write_text("not a certificate")
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", _bad_cert(s["root"], "key")], "holds a private key"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", _bad_cert(s["root"], "leaf")], "not a CA"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", _bad_cert(s["root"], "text")], "no PEM certificate"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", "/nonexistent.pem"], "does not exist"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--proxy", "not-a-port"], "is not HOST:PORT"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--system-roots", s["ca"] + ".nope"], "does not exist"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--bundle-path", "/x'y"], "plain path"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--bundle", _blocked_wgetrc(s["root"])],
         "cannot write the wgetrc"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--artifact", str(s["root"] / "egresslaw.json"),
                    "--keys", str(s["root"] / "keys"), "--profile", "package-builder"], "not both"),
        (lambda s: ["--ca", s["ca"]], "no lease"),
        (lambda s: ["--keys", str(s["root"] / "keys"), "--profile", "package-bulder", "--artifact", str(s["root"] / "egresslaw.json"),
                    "--ca", s["ca"]], "did you mean `package-builder`?"),
        (lambda s: ["--lease-file", str(s["root"] / "lease.txt"), "--ca", s["ca"], "--artifact", str(s["root"] / "egresslaw.json"),
                    "--format", "json"], None),  # the lease's profile is in the artifact: fine
    ],
)
def test_errors_are_clear_and_never_print_the_lease(setup, args, message):
    extra = args(setup)
    done = _run(setup, *extra)
    if message is None:
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 2 and done.stdout == "", done
    assert message in done.stderr and "Traceback" not in done.stderr
    assert setup["lease"] not in done.stderr and setup["lease"].split(".")[2] not in done.stderr


def test_a_lease_file_that_holds_something_else_is_not_quoted(setup):
    secret = "ghp_NotALeaseButASecret0123456789abcdef"
    path = setup["root"] / "wrong.txt"
    path.write_text(secret)
    done = _run(setup, "--lease-file", str(path), "--ca", setup["ca"])
    assert done.returncode == 2 and "does not hold one lease token" in done.stderr and secret not in done.stderr + done.stdout
