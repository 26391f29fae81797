"""Bad input to every `egresslaw` command, as an outside tester would give it, one row a case.

Each row runs the real CLI in this process (`egresslaw.cli.main`) and asserts: no traceback and no
"internal error", the documented exit code, an error naming the offending file or flag, a `help:`
line where the CLI owes a fix, and the canary secret (sealed in the store, piped on stdin, put in a
header or a database URL) in no output. Nothing here proves a policy or starts a listener.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from egresslaw.cli import main
from tests.proxy_harness import CANARY, assert_no_canary

pytestmark = pytest.mark.timeout(60)  # a FIFO opened for reading blocks: a regression must fail, not hang
ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "policies" / "demo"
ADDR = ["--workspace", "acme", "--connection", "github", "--handle", "gh"]


def _run(monkeypatch, capsys, argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """A compiled artifact, a keys directory, a store holding the canary, and a directory of bad files."""
    t = tmp_path_factory.mktemp("bad-input")
    policy = t / "policy"
    shutil.copytree(DEMO, policy)
    assert main(["compile", str(policy), "-o", str(t / "a.json"), "-q"]) == 0
    assert main(["keys", "init", "--dir", str(t / "keys")]) == 0
    artifact = json.loads((t / "a.json").read_text())

    def put(name: str, data: bytes | str) -> None:
        path = t / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())

    put("empty", b"")
    put("binary", b"\xff\xfe\x00\x81not text")
    put("trunc.json", (t / "a.json").read_text()[:200])
    put("wrongtype.json", json.dumps({**artifact, "connections": "github"}))
    put("wrongshape.json", "[1, 2, 3]")
    put("tampered.json", json.dumps({**artifact, "workspace": "evil"}))
    put("proof99.json", json.dumps({"format": "egresslaw.proof/99", "artifact_digest": artifact["digest"]}))
    put("nul/p.egress", 'egresslaw 1\x00\nworkspace "w"\n')
    put("bin/p.egress", b"\xff\xfe\x81")
    put("emptypol/p.egress", b"")
    put("huge/p.egress", "egresslaw 1\n# " + "x" * 1_000_000 + "\n")
    put("notsqlite.db", "this is not SQLite\n" * 20)
    put("store-dir/.keep", "")
    put("log/midline.log", '{"format": "egresslaw.audit/2", "seq": 0, "kind": "audit-op')
    put("log/notjson.log", "hello\nworld\n")
    put("log/empty.log", "")
    put("log/wrongshape.log", '[1, 2]\n{"seq": "x"}\n')
    put("jsonl/bad.jsonl", '{"kind": "request"}\nnot json\n')
    os.mkfifo(t / "fifo")
    (t / "broken").symlink_to(t / "nowhere")

    def keys_variant(name: str, change) -> None:
        shutil.copytree(t / "keys", t / name)
        change(t / name)

    keys_variant("keys-777", lambda d: d.chmod(0o777))
    keys_variant("keys-644", lambda d: (d / "lease.key").chmod(0o644))
    keys_variant("keys-trunc", lambda d: os.truncate(d / "lease.key", 20))
    keys_variant("keys-trunc-custody", lambda d: os.truncate(d / "custody.key", 20))
    keys_variant("keys-fifo", lambda d: ((d / "lease.key").unlink(), os.mkfifo(d / "lease.key")))
    keys_variant("keys-wrongjson", lambda d: (d / "custody.key").write_text('{"keys": 5}'))

    store = t / "custody.db"
    code = _main_with_stdin(["custody", "put", "--keys", str(t / "keys"), "--store", str(store), *ADDR], CANARY.encode())
    assert code == 0
    return {"T": str(t), "A": str(t / "a.json"), "K": str(t / "keys"), "S": str(store)}


def _main_with_stdin(argv: list[str], stdin: bytes) -> int:
    saved = sys.stdin
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        return main(argv)
    finally:
        sys.stdin = saved


# (id, argv, stdin, exit code, what the error must name (after formatting), a `help:` line required)
CASES = [
    # -- artifact readers: show, explain, diff, prove, lease --artifact
    ("show-missing", ["show", "{T}/nope.json"], b"", 2, ["{T}/nope.json", "does not exist"], True),
    ("show-dir", ["show", "{T}"], b"", 2, ["{T}", "is a directory"], True),
    ("show-under-file", ["show", "{T}/empty/x.json"], b"", 2, ["{T}/empty/x.json"], True),
    ("show-broken-link", ["show", "{T}/broken"], b"", 2, ["{T}/broken", "does not exist"], True),
    ("show-binary", ["show", "{T}/binary"], b"", 2, ["{T}/binary", "not UTF-8"], True),
    ("show-empty", ["show", "{T}/empty"], b"", 2, ["{T}/empty", "not JSON"], False),
    ("show-truncated", ["show", "{T}/trunc.json"], b"", 2, ["{T}/trunc.json", "not JSON"], False),
    ("show-wrong-type", ["show", "{T}/wrongtype.json"], b"", 2, ["{T}/wrongtype.json"], False),
    ("show-wrong-shape", ["show", "{T}/wrongshape.json"], b"", 2, ["{T}/wrongshape.json"], False),
    ("show-tampered", ["show", "{T}/tampered.json"], b"", 2, ["{T}/tampered.json", "digest"], False),
    ("show-policy-source", ["show", "{T}/policy/github.egress"], b"", 2, ["{T}/policy/github.egress", "policy source"], True),
    ("explain-dir", ["explain", "{T}", "--connection", "github", "GET https://api.github.com/"], b"", 2, ["{T}", "is a directory"], True),
    ("explain-tampered", ["explain", "{T}/tampered.json", "--connection", "github", "GET https://api.github.com/"], b"", 2,
     ["{T}/tampered.json", "digest"], False),
    ("explain-bad-header", ["explain", "{A}", "--connection", "github", "GET https://api.github.com/", "-H", "nocolon"], b"", 2,
     ["`nocolon …`"], True),
    ("explain-header-without-colon", ["explain", "{A}", "--connection", "github", "GET https://api.github.com/", "-H",
                                      f"Authorization Bearer {CANARY}"], b"", 2, ["`Authorization …`"], True),
    ("explain-unknown-connection", ["explain", "{A}", "--connection", "nope", "GET https://api.github.com/"], b"", 2, ["`nope`"], True),
    ("explain-conflicting-subjects", ["explain", "{A}", "--connection", "github", "--profile", "trusted-ci", "x:443"], b"", 2,
     ["--profile", "not allowed with argument --connection"], False),
    ("diff-truncated-new", ["diff", "{A}", "{T}/trunc.json"], b"", 2, ["{T}/trunc.json"], False),
    ("diff-examples-0", ["diff", "{A}", "{A}", "--examples", "0"], b"", 2, ["--examples 0"], False),
    ("diff-timeout-negative", ["diff", "{A}", "{A}", "--timeout-ms", "-1"], b"", 2, ["--timeout-ms -1"], True),
    ("prove-wrong-version", ["prove", "{T}/proof99.json", "-o", "{T}/out.json"], b"", 2, ["{T}/proof99.json", "format"], False),
    ("prove-jobs-0", ["prove", "{A}", "--jobs", "0"], b"", 2, ["--jobs 0"], True),
    ("prove-jobs-huge", ["prove", "{A}", "--jobs", "99999999999999999999999"], b"", 2, ["--jobs 99999999999999999999999"], True),
    ("prove-jobs-nan", ["prove", "{A}", "--jobs", "nan"], b"", 2, ["--jobs", "nan"], False),
    ("prove-timeout-0", ["prove", "{A}", "--timeout-ms", "0"], b"", 2, ["--timeout-ms 0"], True),
    ("prove-timeout-wraps", ["prove", "{A}", "--timeout-ms", "4294967296"], b"", 2, ["--timeout-ms 4294967296"], True),
    ("prove-timeout-1e309", ["prove", "{A}", "--timeout-ms", "1e309"], b"", 2, ["--timeout-ms", "1e309"], False),
    ("prove-rlimit-negative", ["prove", "{A}", "--rlimit", "-1"], b"", 2, ["--rlimit -1"], True),
    ("prove-rlimit-huge", ["prove", "{A}", "--rlimit", "99999999999999999999"], b"", 2, ["--rlimit 99999999999999999999"], True),
    ("prove-against-dir", ["prove", "{A}", "--against", "{T}", "-o", "{T}/out.json"], b"", 2, ["{T}", "is a directory"], True),
    ("prove-sign-fifo", ["prove", "{A}", "--sign", "{T}/fifo", "-o", "{T}/out.json"], b"", 2, ["{T}/fifo", "not a regular file"], True),
    ("lease-artifact-tampered", ["lease", "--keys", "{K}", "--profile", "trusted-ci", "--artifact", "{T}/tampered.json"], b"", 2,
     ["{T}/tampered.json"], False),
    # -- policy readers: check, compile, fmt, import-cma
    ("check-missing", ["check", "{T}/nope.egress"], b"", 2, ["{T}/nope.egress", "does not exist"], True),
    ("check-fifo", ["check", "{T}/fifo"], b"", 2, ["{T}/fifo", "not a regular file"], True),
    ("check-nul", ["check", "{T}/nul/p.egress"], b"", 1, ["{T}/nul/p.egress:1:", "NUL"], True),
    ("check-binary", ["check", "{T}/bin/p.egress"], b"", 2, ["{T}/bin/p.egress", "UTF-8"], True),
    ("check-empty", ["check", "{T}/emptypol/p.egress"], b"", 1, ["{T}/emptypol/p.egress:1:1"], True),
    ("check-huge-line", ["check", "{T}/huge/p.egress"], b"", 1, ["{T}/huge/p.egress"], True),
    ("compile-nul", ["compile", "{T}/nul", "-o", "{T}/out.json"], b"", 1, ["{T}/nul/p.egress:1:", "NUL"], True),
    ("compile-missing", ["compile", "{T}/nope", "-o", "{T}/out.json"], b"", 2, ["{T}/nope", "does not exist"], True),
    ("fmt-binary", ["fmt", "--check", "{T}/bin/p.egress"], b"", 2, ["{T}/bin/p.egress", "UTF-8"], True),
    ("import-cma-dir", ["import-cma", "{T}"], b"", 2, ["{T}", "is a directory"], True),
    ("import-cma-binary", ["import-cma", "{T}/binary"], b"", 2, ["{T}/binary", "not UTF-8"], True),
    ("import-cma-wrong-shape", ["import-cma", "{T}/wrongshape.json"], b"", 1, ["{T}/wrongshape.json", "not an object"], True),
    # -- keys directories and key files
    ("lease-keys-missing", ["lease", "--keys", "{T}/nokeys", "--profile", "trusted-ci"], b"", 2, ["{T}/nokeys", "does not exist"], True),
    ("lease-keys-is-file", ["lease", "--keys", "{T}/empty", "--profile", "trusted-ci"], b"", 2, ["{T}/empty", "not a directory"], True),
    ("lease-keys-world-writable", ["lease", "--keys", "{T}/keys-777", "--profile", "trusted-ci"], b"", 2,
     ["{T}/keys-777", "writable by group or others"], True),
    ("lease-key-0644", ["lease", "--keys", "{T}/keys-644", "--profile", "trusted-ci"], b"", 2, ["{T}/keys-644/lease.key", "0644"], True),
    ("lease-key-truncated", ["lease", "--keys", "{T}/keys-trunc", "--profile", "trusted-ci"], b"", 2,
     ["{T}/keys-trunc/lease.key", "malformed"], True),
    ("lease-key-fifo", ["lease", "--keys", "{T}/keys-fifo", "--profile", "trusted-ci"], b"", 2,
     ["{T}/keys-fifo/lease.key", "not a regular file"], True),
    ("lease-ttl-0", ["lease", "--keys", "{K}", "--profile", "trusted-ci", "--ttl", "0"], b"", 2, ["ttl"], False),
    ("lease-ttl-huge", ["lease", "--keys", "{K}", "--profile", "trusted-ci", "--ttl", "99999999999999999999"], b"", 2, ["ttl"], False),
    ("lease-ttl-nan", ["lease", "--keys", "{K}", "--profile", "trusted-ci", "--ttl", "nan"], b"", 2, ["--ttl", "nan"], False),
    ("lease-both-subjects", ["lease", "--keys", "{K}", "--profile", "p", "--connection", "c"], b"", 2, ["--connection"], False),
    ("keys-rotate-overlap-negative", ["keys", "rotate", "--lease", "--dir", "{T}/keys-trunc-custody", "--overlap", "-1"], b"", 2,
     ["--overlap `-1`"], True),
    ("keys-rotate-overlap-huge", ["keys", "rotate", "--lease", "--dir", "{T}/keys-trunc-custody", "--overlap", "99999999999999999999999"],
     b"", 2, ["--overlap `99999999999999999999999`"], True),
    ("keys-rotate-overlap-past-any-lease", ["keys", "rotate", "--lease", "--dir", "{T}/keys-trunc-custody", "--overlap", "99999999999"],
     b"", 2, ["--overlap `99999999999`"], True),
    ("keys-init-over-a-file", ["keys", "init", "--dir", "{T}/empty"], b"", 2, ["{T}/empty"], False),
    # -- custody: stores, secrets on stdin, numbers (the canary is piped or sealed in every one)
    ("custody-init-over-a-store", ["custody", "init", "--keys", "{K}", "--store", "{S}"], b"", 2, ["{S}", "never overwritten"], True),
    ("custody-init-over-a-dir", ["custody", "init", "--keys", "{K}", "--store", "{T}/store-dir"], b"", 2, ["{T}/store-dir"], True),
    ("custody-put-empty-stdin", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", *ADDR], b"", 1, ["secret is empty"], True),
    ("custody-put-newline-only", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", *ADDR], b"\n", 1, ["secret is empty"], True),
    ("custody-put-nul", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", *ADDR], CANARY.encode() + b"\x00x", 1, ["NUL"], True),
    ("custody-put-two-lines", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", *ADDR], CANARY.encode() + b"\n\n", 1, ["LF"], True),
    ("custody-put-too-long", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", *ADDR], CANARY.encode() * 1000, 1,
     ["longer than"], True),
    ("custody-put-store-not-sqlite", ["custody", "put", "--keys", "{K}", "--store", "{T}/notsqlite.db", *ADDR], CANARY.encode(), 2,
     ["{T}/notsqlite.db", "not a usable custody store"], True),
    ("custody-put-store-is-dir", ["custody", "put", "--keys", "{K}", "--store", "{T}/store-dir", *ADDR], CANARY.encode(), 2,
     ["{T}/store-dir", "not a regular file"], True),
    ("custody-put-store-under-file", ["custody", "put", "--keys", "{K}", "--store", "{T}/empty/x.db", *ADDR], CANARY.encode(), 2,
     ["{T}/empty/x.db"], True),
    ("custody-put-keys-trunc", ["custody", "put", "--keys", "{T}/keys-trunc-custody", "--store", "{T}/new.db", *ADDR], CANARY.encode(), 2,
     ["{T}/keys-trunc-custody/custody.key", "malformed"], True),
    ("custody-put-keys-wrong-json", ["custody", "put", "--keys", "{T}/keys-wrongjson", "--store", "{T}/new.db", *ADDR], CANARY.encode(), 2,
     ["{T}/keys-wrongjson/custody.key", "format"], True),
    ("custody-put-control-in-handle", ["custody", "put", "--keys", "{K}", "--store", "{T}/new.db", "--workspace", "w", "--connection", "c",
                                       "--handle", "h\n"], CANARY.encode(), 1, ["handle"], False),
    ("custody-put-secret-as-argument", ["custody", "put", "--keys", "{K}", "--store", "{S}", *ADDR, CANARY], b"", 2, ["unrecognized arguments: …"], False),
    ("custody-put-secret-as-option", ["custody", "put", "--keys", "{K}", "--store", "{S}", *ADDR, f"--secret={CANARY}"], b"", 2,
     ["unrecognized arguments: --secret=…"], False),
    ("custody-put-database-password", ["custody", "put", "--keys", "{K}", "--store", f"postgresql://u:{CANARY}@127.0.0.1:1/db", *ADDR],
     CANARY.encode(), 2, ["postgresql://u:***@127.0.0.1:1/db"], True),
    ("custody-list-store-missing", ["custody", "list", "--keys", "{K}", "--store", "{T}/nope.db"], b"", 2, ["{T}/nope.db", "does not exist"], True),
    ("custody-list-store-dir", ["custody", "list", "--keys", "{K}", "--store", "{T}/store-dir"], b"", 2, ["{T}/store-dir"], True),
    ("custody-list-keys-truncated", ["custody", "list", "--keys", "{T}/keys-trunc-custody", "--store", "{S}"], b"", 2,
     ["{T}/keys-trunc-custody/custody.key"], True),
    ("custody-delete-missing-record", ["custody", "delete", "--keys", "{K}", "--store", "{S}", "--workspace", "w", "--connection", "c",
                                       "--handle", "none"], b"", 1, ["w/c/none"], False),
    ("custody-rotate-store-not-sqlite", ["custody", "rotate", "--keys", "{K}", "--store", "{T}/notsqlite.db"], b"", 2,
     ["{T}/notsqlite.db"], True),
    ("custody-lock-timeout-nan", ["custody", "list", "--keys", "{K}", "--store", "{S}", "--lock-timeout", "nan"], b"", 2, ["--lock-timeout", "nan"], False),
    ("custody-lock-timeout-1e309", ["custody", "list", "--keys", "{K}", "--store", "{S}", "--lock-timeout", "1e309"], b"", 2, ["--lock-timeout"], False),
    ("custody-lock-timeout-negative", ["custody", "list", "--keys", "{K}", "--store", "{S}", "--lock-timeout", "-1"], b"", 2, ["--lock-timeout"], False),
    # -- audit verify
    ("audit-missing", ["audit", "verify", "{T}/log/nope.log"], b"", 2, ["{T}/log/nope.log", "does not exist"], False),
    ("audit-truncated-mid-line", ["audit", "verify", "{T}/log/midline.log"], b"", 3, ["{T}/log/midline.log", "line 1"], False),
    ("audit-not-json", ["audit", "verify", "{T}/log/notjson.log"], b"", 1, ["{T}/log/notjson.log", "line 1: not JSON"], False),
    ("audit-empty", ["audit", "verify", "{T}/log/empty.log"], b"", 1, ["{T}/log/empty.log", "empty"], False),
    ("audit-wrong-shape", ["audit", "verify", "{T}/log/wrongshape.log"], b"", 1, ["{T}/log/wrongshape.log", "line 1"], False),
    ("audit-public-key-empty", ["audit", "verify", "{T}/log/notjson.log", "--public-key", "{T}/empty"], b"", 2, ["{T}/empty"], False),
    ("audit-keys-trunc", ["audit", "verify", "{T}/log/notjson.log", "--keys", "{T}/keys-trunc"], b"", 1, ["{T}/log/notjson.log"], False),
    ("audit-both-keys", ["audit", "verify", "{T}/log/notjson.log", "--keys", "{K}", "--public-key", "{T}/empty"], b"", 2, ["--public-key"], False),
    ("propose-missing-audit", ["propose", "--audit", "{T}/nope", "{T}/policy"], b"", 2, ["{T}/nope", "does not exist"], True),
    ("propose-no-logs", ["propose", "--audit", "{T}/log", "{T}/policy"], b"", 2, ["holds no audit log"], True),
    ("propose-not-json", ["propose", "--audit", "{T}/jsonl", "{T}/policy"], b"", 2, ["{T}/jsonl/bad.jsonl", "line 2"], True),
    ("propose-no-audit-key", ["propose", "--audit", "{T}/jsonl", "--keys", "{T}/nokeys", "{T}/policy"], b"", 2, ["audit.key"], True),
    # -- sandbox-env, ca
    ("sandbox-run-no-command", ["sandbox-run", "--proxy", "127.0.0.1:8080"], b"", 2, ["no command given"], True),
    ("sandbox-run-proxy-not-address", ["sandbox-run", "--proxy", "nope", "--", "true"], b"", 2, ["--proxy `nope`"], True),
    ("sandbox-run-inside-port-range", ["sandbox-run", "--inside-port", "99999", "--", "true"], b"", 2, ["--inside-port", "99999"], False),
    ("sandbox-run-lease-is-canary", ["sandbox-run", "--proxy", "127.0.0.1:8080", "--lease-file", "-", "--", "true"], CANARY.encode(), 2,
     ["lease file `-`"], True),
    ("sandbox-env-lease-empty-stdin", ["sandbox-env", "--proxy", "127.0.0.1:8080", "--lease-file", "-", "--confdir", "{T}/conf",
                                       "--bundle", "{T}/b.pem"], b"", 2, ["lease file `-`"], True),
    ("sandbox-env-lease-is-canary", ["sandbox-env", "--proxy", "127.0.0.1:8080", "--lease-file", "-", "--confdir", "{T}/conf",
                                     "--bundle", "{T}/b.pem"], CANARY.encode(), 2, ["lease file `-`"], True),
    ("sandbox-env-lease-file-dir", ["sandbox-env", "--proxy", "127.0.0.1:8080", "--lease-file", "{T}", "--confdir", "{T}/conf",
                                    "--bundle", "{T}/b.pem"], b"", 2, ["{T}"], False),
    ("sandbox-env-lease-and-keys", ["sandbox-env", "--proxy", "127.0.0.1:8080", "--lease-file", "-", "--keys", "{K}", "--profile", "p",
                                    "--confdir", "{T}/conf", "--bundle", "{T}/b.pem"], b"a.b.c", 2, ["--lease-file", "--keys"], False),
    ("sandbox-env-ttl-negative", ["sandbox-env", "--proxy", "127.0.0.1:8080", "--keys", "{K}", "--profile", "trusted-ci", "--ttl", "-1",
                                  "--confdir", "{T}/conf", "--bundle", "{T}/b.pem"], b"", 2, ["ttl"], False),
    ("ca-confdir-is-file", ["ca", "--confdir", "{T}/empty"], b"", 2, ["--confdir", "{T}/empty"], True),
    # -- proxy: argument validation only (each fails before anything listens)
    ("proxy-drain-grace-nan", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--drain-grace", "nan"], b"", 2,
     ["--drain-grace", "nan"], False),
    ("proxy-drain-grace-inf", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--drain-grace", "inf"], b"", 2,
     ["--drain-grace", "inf"], False),
    ("proxy-drain-grace-negative", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--drain-grace", "-1"], b"", 2,
     ["--drain-grace", "-1"], False),
    ("proxy-workers-0", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--workers", "0"], b"", 2, ["--workers"], False),
    ("proxy-audit-sync-nan", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--audit-sync", "nan"], b"", 2,
     ["--audit-sync"], False),
    ("proxy-max-body-negative", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--max-body", "-1"], b"", 2,
     ["--max-body"], False),
    ("proxy-listen-port-range", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--listen", "127.0.0.1:99999"],
     b"", 2, ["--listen", "127.0.0.1:99999"], False),
    ("proxy-header-timeout-inf", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--header-timeout", "inf"],
     b"", 2, ["--header-timeout", "inf"], False),
    ("proxy-proof-wrong-version", ["proxy", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--store", "{S}",
                                   "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--workers", "1", "--confdir", "{T}/conf",
                                   "--audit-log", "{T}/audit.log"], b"", 2, ["{T}/proof99.json", "egresslaw.proof/99"], True),
    ("proxy-artifact-tampered", ["proxy", "--artifact", "{T}/tampered.json", "--proof", "{T}/proof99.json", "--keys", "{K}", "--store", "{S}",
                                 "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--workers", "1", "--confdir", "{T}/conf",
                                 "--audit-log", "{T}/audit.log"], b"", 2, ["{T}/tampered.json"], False),
    # -- lane: bad arguments and a tampered artifact fail before Envoy starts (exit 2, nothing listening)
    ("lane-drain-grace-nan", ["lane", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--drain-grace", "nan"], b"", 2,
     ["--drain-grace", "nan"], False),
    ("lane-listen-port-range", ["lane", "--artifact", "{A}", "--proof", "{T}/proof99.json", "--keys", "{K}", "--listen", "127.0.0.1:99999"],
     b"", 2, ["--listen", "127.0.0.1:99999"], False),
    ("lane-artifact-tampered", ["lane", "--artifact", "{T}/tampered.json", "--proof", "{T}/proof99.json", "--keys", "{K}",
                                "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--confdir", "{T}/conf", "--run-dir", "{T}/lane",
                                "--audit-log", "{T}/lane-audit.log"], b"", 2, ["{T}/tampered.json"], False),
    # -- the top level
    ("unknown-command", ["nope"], b"", 2, ["invalid choice", "nope"], False),
    ("no-command", [], b"", 2, ["COMMAND"], False),
]


@pytest.mark.parametrize(("argv", "stdin", "code", "names", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_a_located_error_never_a_traceback(world, monkeypatch, capsys, argv, stdin, code, names, fix):
    monkeypatch.chdir(world["T"])  # a default path (custody.db, build/proof.json) never lands in the repository
    got, out, err = _run(monkeypatch, capsys, [a.format(**world) for a in argv], stdin)
    assert "Traceback" not in out + err and "internal error" not in err, err
    assert got == code, (got, err)
    for name in names:
        assert name.format(**world) in err, (name, err)
    if fix:
        assert "\nhelp: " in err or err.startswith("help: "), err
    assert_no_canary(out + err, "the output of a failing command")


def test_every_command_is_attacked():
    """A new command added without a bad-input row here fails this test."""
    from egresslaw.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    attacked = {c[1][0] for c in CASES if c[1]}
    assert set(commands) <= attacked, set(commands) - attacked
