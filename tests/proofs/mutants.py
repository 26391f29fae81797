"""Mutation testing of the decision core: plant one semantic bug, run `egresslaw prove`, expect a refutation.

Each mutant replaces one exact snippet of `egress_proxy/decision/core.py` (or the policy data it reads,
`compiler/constants.py`) in memory: a child process installs an import hook that serves the
mutated source for that module (no file in the worktree changes), then runs the real
`egresslaw prove` CLI on an artifact that exercises the mutation. The proxy's `decide()` and the
prover both run the mutant, because both run the core. The child also replays every refuted
counterexample through the mutated `decide()`/judge; the parent replays it through the real code.

A property-breaking mutant counts as refuted when `prove` refutes its property for a check the
unmutated core proves, and the counterexample shows the violation on the mutated code and not on
the real one. An equivalent mutant (listed with the reason no property changes) must leave every
verdict as the unmutated core gives it.

    .venv/bin/python -m tests.proofs.mutants child MUTANT ARTIFACT OUT    (what the harness spawns)
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.abc
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = "egress_proxy.decision.core"
DATA = "compiler.constants"


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    original: str  # occurs exactly once in the module's source
    replacement: str
    artifact: str  # "basic" | "workers" | "broker"
    breaks: str | None  # the property it makes false, or None for an equivalent mutant
    why: str  # what the bug is; for an equivalent mutant, why no property changes


def _m(id_: str, original: str, replacement: str, artifact: str, breaks: str | None, why: str, module: str = CORE) -> Mutant:
    return Mutant(id_, module, original, replacement, artifact, breaks, why)


MUTANTS: tuple[Mutant, ...] = (
    # --- address judging ------------------------------------------------------------------------------
    _m("deny6-skipped", '    if within(x, w.deny6):\n        return "address-denied"\n', "", "workers", "deny-cidrs",
       "deny_cidrs are not checked for IPv6 answers"),
    _m("deny-embedded-skipped", "        if in_form(form, x) and within(embedded(form, x), w.deny4):",
       "        if False and in_form(form, x):", "workers", "deny-cidrs", "an IPv4 address embedded in an IPv6 answer is not checked against deny_cidrs"),
    _m("deny-embedded-wrong-table", "        if in_form(form, x) and within(embedded(form, x), w.deny4):",
       "        if in_form(form, x) and within(embedded(form, x), w.deny6):", "workers", "deny-cidrs",
       "embedded IPv4 addresses are compared with the IPv6 deny list"),
    _m("deny4-skipped", '        if within(x, w.deny4):\n            return "address-denied"\n', "", "workers", "deny-cidrs",
       "deny_cidrs are not checked for IPv4 answers"),
    _m("allow-beats-deny", "    if not is6:\n        if within(x, w.deny4):",
       '    if not is6:\n        if within(x, w.allow4):\n            return ""\n        if within(x, w.deny4):', "workers", "deny-cidrs",
       "an allow_cidrs hole wins over deny_cidrs"),
    _m("ipv6-switch-ignored", '    if not w.ipv6:\n        return "ipv6-disabled"\n', "", "workers", "deny-cidrs",
       "ipv6 = false is ignored"),
    _m("6to4-wrong-bits", '"bits 16-47": (((80, 32),), 0, 0, 0)', '"bits 16-47": (((64, 32),), 0, 0, 0)', "basic", "public-only",
       "6to4 reads the IPv4 address from bits 32-63"),
    _m("rfc6052-u-octet-forgotten", "        out.append((56 - after, after))", "        out.append((64 - after, after))", "basic",
       "public-only", "RFC 6052 layouts read the u octet (bits 64-71) as part of the IPv4 address"),
    _m("teredo-not-inverted", '"low 32 bits xor 0xffffffff": (((0, 32),), V4_MAX, 0, 0)',
       '"low 32 bits xor 0xffffffff": (((0, 32),), 0, 0, 0)', "workers", "deny-cidrs",
       "the Teredo client address is read without inverting its bits"),
    _m("isatap-g-bit-forgotten", "(((0, 32),), 0, 0xFCFFFFFF, 0x00005EFE)", "(((0, 32),), 0, 0xFDFFFFFF, 0x00005EFE)", "basic",
       "public-only", "ISATAP interface ids with the g bit set are not unwrapped"),
    _m("isatap-marker-ignored", "(((0, 32),), 0, 0xFCFFFFFF, 0x00005EFE)", "(((0, 32),), 0, 0, 0)", "basic", None,
       "every IPv6 address is then also judged by its low 32 bits: it only refuses more addresses"),
    _m("every-container-judged", '        container = entry.judge == "container and embedded"', "        container = True", "basic", None,
       "judging the container of IPv4-mapped, compatible and NAT64 forms (all inside ::/3) only refuses more addresses"),
    _m("container-skipped", "    if container and not within(x, w.allow6) and within(x, w.special6):", "    if False:", "basic",
       "public-only", "IPv6 answers are never judged against the table"),
    _m("allow6-inverted", "    if container and not within(x, w.allow6) and within(x, w.special6):",
       "    if container and within(x, w.allow6) and within(x, w.special6):", "basic", "public-only",
       "the IPv6 allow_cidrs test is inverted"),
    _m("nat64-worker-prefixes-ignored", "        prefixes = worker.nat64_prefixes if entry.form == NAT64_FORM else (entry.prefix,)",
       "        prefixes = (entry.prefix,)", "workers", "public-only",
       "the worker's nat64_prefixes are not unwrapped (the catalog's 64:ff9b::/96 is, instead)"),
    _m("embedded-not-judged", "            if not public4(w, embedded(form, x)):", "            if False:", "basic", "public-only",
       "an embedded IPv4 address is never judged"),
    _m("special4-ignored", "    return within(v4, w.allow4) or not within(v4, w.special4)", "    return True", "basic", "public-only",
       "IPv4 addresses are never judged against the table"),
    _m("cidr-one-bit-narrower", "            spans.append((int(net.network_address), int(net.broadcast_address)))",
       "            spans.append((int(net.network_address), int(net.network_address) + net.num_addresses // 2 - 1))", "basic",
       "public-only", "every CIDR covers half its addresses (the table's ranges shrink)"),
    _m("cidr-one-bit-wider", "        net = ipaddress.ip_network(cidr, strict=False)\n        if net.version == version:",
       "        net = ipaddress.ip_network(cidr, strict=False)\n        net = net.supernet() if net.prefixlen else net\n"
       "        if net.version == version:", "workers", "public-only", "every CIDR is one bit wider (an allow_cidrs hole grows)"),
    _m("only-first-answer-judged", "    for present, valid, is6, x in answers:", "    for present, valid, is6, x in answers[:1]:", "basic", "public-only",
       "only the first resolver answer is judged"),
    _m("no-answers-admitted", '    if not seen:\n        return "resolve-failed"', '    if not seen:\n        return ""', "basic", None,
       "with no answer there is nothing to dial (the adapter also refuses an empty resolution before deciding); "
       "every property speaks of the answers that may be dialled"),
    # --- destination and rule match ------------------------------------------------------------------------
    _m("http-for-connections", 'CONNECTION_SCHEMES = ("https",)', 'CONNECTION_SCHEMES = ("https", "http")', "basic",
       "credential-scope", "connection traffic may be plain http"),
    _m("scheme-unchecked", '    if o.scheme not in s.schemes:\n        return "scheme-not-allowed"\n', "", "basic", "credential-scope",
       "the scheme is never checked"),
    _m("port-range-unchecked", '    if not 1 <= o.port <= 65535:\n        return "port-invalid"\n', "", "basic", None,
       "a port outside 1-65535 still has to be a declared (host, port), and declared ports are in range"),
    _m("host-error-ignored", "    if o.host_error:\n        return o.host_error\n", "", "basic", None,
       "a refused host reaches the core as the empty name, which no rule or allowlist names"),
    _m("ip-literal-switch-ignored", '        if not s.worker.ip_literals:\n            return "ip-literal-refused"\n', "", "basic", None,
       "an IP literal then still has to be a declared host, and compiled artifacts declare names only"),
    _m("ip-literal-not-judged", "        reason = judge_address(s.worker, o.ip6, o.ip)", '        reason = ""', "basic", None,
       "the same: the literal is refused as no declared host, and every resolver answer is judged anyway"),
    _m("profile-any-host", "    if (o.host, o.port) not in s.destinations:\n        return s.miss\n", "", "basic", "profile-scope",
       "a destination need not be declared (profiles reach any host)"),
    _m("method-set-unchecked", '    if o.method not in METHODS:\n        return "method-not-allowed", -1\n', "", "basic", None,
       "connection rules list methods from METHODS only, and no property limits a profile's methods"),
    _m("upgrade-ignored", '    if o.upgrade:\n        return "upgrade-denied", -1\n', "", "basic", None,
       "protocol upgrades are refused for hygiene; no property states it, and `upgrade` is never forwarded anyway"),
    _m("path-error-ignored", "    if o.path_error:\n        return o.path_error, -1\n", "", "basic", "credential-scope",
       "a refused path still reaches rule matching (as the empty path, which a `/` rule admits)"),
    _m("port-ignored-in-match", "    return rule.host == o.host and rule.port == o.port and o.method in rule.methods",
       "    return rule.host == o.host and o.method in rule.methods", "basic", "credential-scope",
       "a rule matches on another port of the same host"),
    _m("host-ignored-in-match", "    return rule.host == o.host and rule.port == o.port and o.method in rule.methods",
       "    return rule.port == o.port and o.method in rule.methods", "basic", "credential-scope",
       "a rule matches another host of the connection"),
    _m("method-ignored-in-match", "    return rule.host == o.host and rule.port == o.port and o.method in rule.methods",
       "    return rule.host == o.host and rule.port == o.port", "basic", "credential-scope", "a rule matches any method"),
    _m("raw-string-prefix", '    return prefix == "/" or path == prefix or path.startswith(prefix + "/")',
       '    return prefix == "/" or path.startswith(prefix)', "basic", "credential-scope",
       "path prefixes match as raw strings (`/repos/acme` admits `/repos/acmex`)"),
    _m("last-rule-named", '            return "", i\n', '            return "", len(s.rules) - 1\n', "basic", "credential-scope",
       "the decision names the wrong rule"),
    _m("method-reason-only", '            return "method-not-allowed", -1\n    return "path-not-allowed", -1',
       '            return "path-not-allowed", -1\n    return "path-not-allowed", -1', "basic", None,
       "it only chooses between two denial reasons"),
    # --- headers -------------------------------------------------------------------------------------------
    _m("x-forwarded-forwarded", 'HEADER_DENYLIST_PREFIXES = ("x-forwarded-", "proxy-", "x-egresslaw-")',
       'HEADER_DENYLIST_PREFIXES = ("proxy-", "x-egresslaw-")', "basic", "header-safety",
       "`x-forwarded-*` is not denylisted (sandbox traffic forwards X-Forwarded-Host)", DATA),
    _m("proxy-prefix-forwarded", 'HEADER_DENYLIST_PREFIXES = ("x-forwarded-", "proxy-", "x-egresslaw-")',
       'HEADER_DENYLIST_PREFIXES = ("x-forwarded-", "x-egresslaw-")', "basic", "header-safety",
       "`proxy-*` is not denylisted", DATA),
    _m("cookie-forwarded", '        "cookie",\n        "forwarded",', '        "forwarded",', "basic", "header-safety",
       "`cookie` is not denylisted", DATA),
    _m("profile-denylist-skipped", "        return is_token(name) and not header_is_denylisted(name)", "        return is_token(name)",
       "basic", "header-safety", "sandbox traffic forwards every header"),
    _m("profile-gets-credential-header", "    if c is None:\n        return None\n    return c.inject_header\n",
       '    if c is None:\n        return "authorization"\n    return c.inject_header\n', "basic",
       "header-safety", "sandbox traffic gets a credential header"),
    _m("allowlist-unfiltered", "        headers = frozenset(h.lower() for h in rule.headers if not header_is_denylisted(h, inject))",
       "        headers = frozenset(h.lower() for h in rule.headers)", "basic", None,
       "only an allowlist that names a denylisted header exposes it, and header-safety refutes such an allowlist as declared"),
    _m("allowlist-of-first-rule", "    allow = s.rules[rule].headers", "    allow = s.rules[0].headers", "basic", "header-safety",
       "every rule forwards the first rule's allowlist (`accept` goes out under `issues`, whose allowlist does not name it)"),
    _m("connection-listed-forwarded", "    if listed_in_connection:\n        return False\n", "", "basic", None,
       "a name listed in `Connection` is hop-by-hop hygiene; a denylisted name is dropped anyway"),
    # --- brokering: a profile's requests that carry a connection's credential ---------------------------------
    _m("broker-outside-rules", "        if admits(rule, o):\n            return i\n    return -1",
       "        if rule.host == o.host and rule.port == o.port:\n            return i\n    return -1", "broker", "credential-scope",
       "the brokered credential attaches to any request to a brokered rule's host and port, outside the rule's methods and path"),
    _m("broker-odd-path", "    if o.scheme not in CONNECTION_SCHEMES or o.path_odd:", "    if o.scheme not in CONNECTION_SCHEMES:", "broker",
       "credential-scope", "a profile path without a normalized form (`/acme/%2E`) is matched as written and gets the credential"),
    _m("broker-over-http", "    if o.scheme not in CONNECTION_SCHEMES or o.path_odd:", "    if o.path_odd:", "broker",
       "credential-scope", "a brokered credential rides plain http"),
    _m("broker-unlisted-connection", "    for name in names:\n", "    for name in connections:\n", "broker", "credential-scope",
       "a profile brokers every connection of the artifact, not only those its `brokers` lists"),
    _m("broker-allowlist-forgotten", '    if s.kind == "profile" and rule < 0:', '    if s.kind == "profile":', "broker", "header-safety",
       "brokered traffic forwards every non-denylisted header instead of the rule's allowlist (the caller's `X-Api-Key` too)"),
    _m("broker-default-worker", "    return c.worker\n", "    return s.worker\n", "broker", "deny-cidrs",
       "brokered traffic is judged by the profile's worker (`default`) instead of the brokered connection's"),
    _m("broker-header-lost", "    return c.inject_header\n", "    return s.inject_header\n", "broker", "header-safety",
       "a brokered request names no credential header (the profile's, None), so the decision does not say where it rides"),
    _m("broker-ignores-trust", '    names = prof.brokers if prof.trust == "trusted" else ()', "    names = prof.brokers", "broker", None,
       "the compiler refuses an adversarial broker (EL0039) and trust-lane refutes one in an artifact as declared; "
       "this check is defence in depth"),
    # --- redirects -----------------------------------------------------------------------------------------
    _m("always-follows", "    if not (w.follow_redirects or w.max_redirects > 0):\n        return False\n", "", "basic",
       "no-redirect", "every worker follows a 3xx once"),
)


def artifact_json(name: str) -> str:
    """The artifact that exercises the mutants marked `name`."""
    from tests.egress_proxy.builders import artifact, connection, profile, rule, worker

    if name == "basic":
        return artifact(
            connections=[
                connection("github", [
                    rule("read", "api.github.com", "/repos/acme", ["GET", "HEAD"], ["accept"]),
                    rule("issues", "api.github.com", "/repos/acme/app/issues", ["POST"], ["content-type"]),
                    rule("alt", "api.github.com", "/alt", ["GET"], port=8443),
                ]),
                connection("uploads", [rule("root", "uploads.example.org", "/", ["PUT"]), rule("docs", "docs.example.org", "/v1")]),
            ],
            profiles=[profile("ci", [("pypi.org", 443), ("deb.debian.org", 80)])],
        ).to_json()
    if name == "broker":
        return artifact(
            connections=[
                connection("gh", [rule("refs", "github.com", "/acme", ["GET", "HEAD"], ["accept"]),
                                  rule("fetch", "github.com", "/acme/app.git/git-upload-pack", ["POST"], ["content-type"])], worker="edge"),
                connection("keyed", [rule("post", "hooks.example.org", "/", ["POST"], ["content-type"])], inject_header="X-Api-Key",
                           inject_format="{secret}"),
                connection("other", [rule("any", "pypi.org", "/", ["GET"])]),
            ],
            profiles=[profile("ci", [("github.com", 443), ("hooks.example.org", 443), ("pypi.org", 443)], brokers=("gh", "keyed")),
                      profile("plain", [("github.com", 443), ("pypi.org", 443)])],
            workers=[worker("edge", deny_cidrs=("8.8.8.0/24",))],
        ).to_json()
    workers = {
        "edge": {"deny_cidrs": ("8.8.8.0/24", "2600:1f00::/32"), "allow_cidrs": ("8.8.0.0/16",)},
        "v4": {"ipv6": False},
        "nat": {"nat64_prefixes": ("2600:1f00::/96",)},
        "wide": {"allow_cidrs": ("11.0.0.0/8",)},
        # the hole makes Teredo answers dialable (public-only refutes it); the deny range inverts to public space
        "teredo": {"allow_cidrs": ("2001::/32",), "deny_cidrs": ("203.0.113.0/24",)},
    }
    return artifact(
        connections=[connection(f"c-{w}", [rule("any", "api.example.com")], worker=w) for w in workers],
        workers=[worker(w, **settings) for w, settings in workers.items()],
    ).to_json()


# -- the child: a process whose core is the mutant ------------------------------------------------------


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, source: str, origin: str) -> None:
        self.name, self.source, self.origin = name, source, origin

    def get_source(self, name: str) -> str:
        return self.source

    def exec_module(self, module) -> None:
        exec(compile(self.source, self.origin, "exec"), module.__dict__)  # noqa: S102 - the mutant under test


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant

    def find_spec(self, fullname, path, target=None):
        if fullname != self.mutant.module:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        source = Path(real.origin).read_text()
        if source.count(self.mutant.original) != 1:
            raise RuntimeError(f"mutant `{self.mutant.id}`: its snippet occurs {source.count(self.mutant.original)} times in {fullname}")
        mutated = source.replace(self.mutant.original, self.mutant.replacement)
        return importlib.util.spec_from_loader(fullname, _Loader(fullname, mutated, f"<mutant {self.mutant.id} of {real.origin}>"))


def install(mutant: Mutant) -> None:
    """Serve the mutated source for the mutant's module from now on (before anything imports it)."""
    assert mutant.module not in sys.modules, f"{mutant.module} is already imported"
    sys.meta_path.insert(0, _Finder(mutant))


def replays(report_doc: dict, artifact_text: str) -> dict[str, object]:
    """Every refuted counterexample replayed through this process's code: decide(), the judge, or the redirect rule."""
    from catalog import load_catalog
    from compiler.artifact import load_artifact
    from egress_proxy.decision import core
    from egress_proxy.decision.adapter import decide
    from egress_proxy.decision.addresses import judge_ip
    from egress_proxy.decision.types import Lease
    from proofs.decode import decision_dict, request_from_dict

    art = load_artifact(artifact_text)
    table = load_catalog(art.catalog.version).special_purpose
    out: dict[str, object] = {}
    for r in report_doc["results"]:
        cex = r.get("counterexample")
        if r["verdict"] != "refuted" or not cex:
            continue
        key = "|".join((r["worker"], r["subject"], r["property"]))
        kind, name = r["subject"].split(":", 1)
        if cex.get("request"):
            lease = Lease("mutants", name if kind == "profile" else None, name if kind == "connection" else None, 0)
            out[key] = decision_dict(decide(art, lease, request_from_dict(cex["request"]), cex["resolved_ips"]))
        elif cex.get("redirect_chain"):
            w = core.worker_table(art.worker(r["worker"]), table)
            out[key] = core.follows_redirect(w, cex["redirect_chain"][0]["status"], 0)
        elif cex.get("resolved_ips"):
            out[key] = list(judge_ip(cex["resolved_ips"][0], art.worker(r["worker"]), table)[:2])
    return out


def child(mutant_id: str, artifact_path: str, out_path: str) -> int:
    mutant = next(m for m in MUTANTS if m.id == mutant_id)
    install(mutant)
    import contextlib
    import io

    from egresslaw.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(["prove", artifact_path, "-o", out_path, "--format", "json"])
    if not Path(out_path).exists():
        sys.stderr.write(err.getvalue())
        return code
    doc = json.loads(Path(out_path).read_text())
    doc["mutant_replays"] = replays(doc, Path(artifact_path).read_text())
    Path(out_path).write_text(json.dumps(doc))
    return code


# -- the parent: run mutants, judge the outcome ------------------------------------------------------------


@dataclass
class Outcome:
    mutant: Mutant
    exit_code: int
    ok: bool  # refuted as expected (breaking) / unchanged (equivalent)
    detail: str


def baseline(name: str, workdir: Path) -> tuple[Path, dict, dict]:
    """The exercising artifact written to disk, the unmutated core's verdicts on it, and its replays."""
    from compiler.artifact import load_artifact
    from proofs.runner import prove

    path = workdir / f"{name}.json"
    text = artifact_json(name)
    path.write_text(text)
    doc = json.loads(prove(load_artifact(text), jobs=1).to_json())
    return path, {(r["worker"], r["subject"], r["property"]): r["verdict"] for r in doc["results"]}, doc


def run_child(mutant: Mutant, artifact_path: Path, workdir: Path) -> tuple[int, dict]:
    out = workdir / f"{mutant.id}.proof.json"
    proc = subprocess.run([sys.executable, "-m", "tests.proofs.mutants", "child", mutant.id, str(artifact_path), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    if not out.exists():  # the prover failed outright (exit 2): a mutant it could not judge is not refuted
        return proc.returncode, {"results": [], "mutant_replays": {}, "error": proc.stderr[-500:]}
    return proc.returncode, json.loads(out.read_text())


def judge(mutant: Mutant, code: int, doc: dict, base: dict, artifact_text: str) -> Outcome:
    """Compare a mutant's report with the baseline (and its replays with the real code's)."""
    verdicts = {(r["worker"], r["subject"], r["property"]): r for r in doc["results"]}
    if mutant.breaks is None:
        changed = sorted(f"{k[2]} {k[1]}: {base.get(k)} -> {r['verdict']}" for k, r in verdicts.items() if base.get(k) != r["verdict"])
        return Outcome(mutant, code, not changed, "unchanged" if not changed else "; ".join(changed))
    real = replays(doc, artifact_text)
    for key, r in sorted(verdicts.items()):
        if key[2] != mutant.breaks or r["verdict"] != "refuted" or base.get(key) != "proved":
            continue
        flat = "|".join(key)
        mutated, actual = doc["mutant_replays"].get(flat), real.get(flat)
        shown = (isinstance(mutated, dict) and mutated["allowed"]) or mutated is True or (isinstance(mutated, list) and mutated[0])
        if shown and mutated != actual:
            return Outcome(mutant, code, True, f"{key[1]}: {r['counterexample']['summary']}")
    unknown = [f"{k[1]}: {r['detail']}" for k, r in verdicts.items() if k[2] == mutant.breaks and r["verdict"] == "unknown"]
    if doc.get("error") is not None:
        unknown.append(f"prove failed: {doc['error'].strip().splitlines()[-1] if doc['error'].strip() else code}")
    return Outcome(mutant, code, False, "not refuted" + (f" (unknown: {unknown[0]})" if unknown else ""))


def evaluate(mutants, jobs: int = 2, progress=None) -> list[Outcome]:
    """Run every mutant in its own process (`jobs` at a time) against its artifact; outcomes in `mutants` order."""
    with tempfile.TemporaryDirectory(prefix="egresslaw-mutants-") as tmp:
        workdir = Path(tmp)
        bases = {name: baseline(name, workdir) for name in sorted({m.artifact for m in mutants})}
        texts = {name: path.read_text() for name, (path, _, _) in bases.items()}

        def one(m: Mutant) -> Outcome:
            code, doc = run_child(m, bases[m.artifact][0], workdir)
            outcome = judge(m, code, doc, bases[m.artifact][1], texts[m.artifact])
            if progress:
                progress(outcome)
            return outcome

        with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, mutants))


def render_markdown() -> str:
    """The mutant list of docs/proofs.md (a test keeps it current)."""
    lines = ["| mutant | planted bug | refuted property (or why it is equivalent) |", "|---|---|---|"]
    for m in MUTANTS:
        if m.breaks:
            lines.append(f"| `{m.id}` | {m.why} | `{m.breaks}` |")
    for m in MUTANTS:
        if not m.breaks:
            lines.append(f"| `{m.id}` | {m.replacement.strip() and 'changed' or 'removed'}: `{m.original.strip().splitlines()[0]}` | equivalent: {m.why} |")
    return "\n".join(lines) + "\n"


def score_line(outcomes: list[Outcome]) -> str:
    breaking = [o for o in outcomes if o.mutant.breaks is not None]
    refuted = sum(o.ok for o in breaking)
    return (f"mutation score: {refuted}/{len(breaking)} property-breaking mutants refuted by prove "
            f"({len(outcomes)} mutants, {len(outcomes) - len(breaking)} equivalent)")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        sys.exit(child(*sys.argv[2:]))
    sys.exit("usage: python -m tests.proofs.mutants child MUTANT ARTIFACT OUT (bench/mutants.py runs the whole set)")
