"""Mutation testing of the decision code: plant one semantic bug, run `egresslaw prove` (or the tests), expect it caught.

Each mutant replaces one exact snippet of one module in memory: a child process installs an import hook
that serves the mutated source for that module (no file in the worktree changes). Three kinds:

- `expect="refuted"`: a bug in the decision core (`egress_proxy/decision/core.py`, the policy data it reads,
  `compiler/constants.py`) or in the code that builds its tables (`egress_proxy/decision/adapter.py`'s index,
  `compiler/normalize.py`). The child runs the real `egresslaw prove` CLI on an artifact that exercises it;
  the proxy's `decide()` and the prover both run the mutant. It counts as refuted when `prove` refutes its
  property for a check the real code proves, and the counterexample shows the violation on the mutated code
  (replayed in the child) and not on the real one (replayed in the parent).
- `expect="unknown"`: a bug the finite model cannot decide (a host compared as a DNS suffix, a method
  case-folded, the answers sliced): `prove` must exit 4 naming the operation for the broken property, never 0.
- `expect="suite"`: a bug in the adapter or the edge, outside the proof: the named tests, run with the mutant
  in every process they start (a `sitecustomize` hook), must fail.

An equivalent mutant (`breaks` None, listed with the reason no property changes) must leave every verdict as
the real code gives it.

A crash is never a verdict: `prove` exiting other than 0, 1 or 4, a traceback from it, or a child that dies fails
the mutant whatever its kind (`Outcome.crashed`, reported `CRASHED` with the last line of the traceback).

    .venv/bin/python -m tests.proofs.mutants child MUTANT ARTIFACT OUT    (what the harness spawns)
    .venv/bin/python -m tests.proofs.mutants run MUTANT EGRESSLAW-ARGS... (the CLI with the mutant installed)
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROVE_EXITS = (0, 1, 4)  # proved, refuted, unknown: anything else from `prove` is a crash
CRASHED = 70  # the child's exit code when `prove` raised
TRACEBACK = "Traceback (most recent call last)"
CORE = "egress_proxy.decision.core"
DATA = "compiler.constants"
ADAPTER = "egress_proxy.decision.adapter"
NORMALIZE = "compiler.normalize"
ATTACH = "egress_proxy.edge.attach"
BINDING = "egress_proxy.edge.binding"
BROKER = "egress_proxy.credentials.broker"
SIGV4_KIND = "egress_proxy.credentials.aws_sigv4"
SHAPES = "egress_proxy.decision.shapes"


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    original: str  # occurs exactly once in the module's source
    replacement: str
    artifact: str  # "basic" | "workers" | "broker" | "minted" | "observed" | "shaped" (prove), or "" for a suite mutant
    breaks: str | None  # the property it makes false, or None for an equivalent mutant
    why: str  # what the bug is; for an equivalent mutant, why no property changes
    expect: str = "refuted"  # "refuted" | "unknown" | "suite"
    tests: tuple[str, ...] = ()  # a suite mutant's tests (pytest node ids), which must fail


def _m(id_: str, original: str, replacement: str, artifact: str, breaks: str | None, why: str, module: str = CORE,
       expect: str = "refuted") -> Mutant:
    return Mutant(id_, module, original, replacement, artifact, breaks, why, expect)


def _suite(id_: str, module: str, original: str, replacement: str, why: str, *tests: str) -> Mutant:
    return Mutant(id_, module, original, replacement, "", "suite", why, "suite", tests)


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
    _m("answers-stop-at-the-first", "        if reason:\n            return reason\n    if not seen:",
       "        return reason\n    if not seen:", "basic", "public-only",
       "the verdict of the first resolver answer is the verdict of all (a later private answer is never judged)"),
    _m("no-answers-admitted", '    if not seen:\n        return "resolve-failed"', '    if not seen:\n        return ""', "basic", "public-only",
       "a request with no resolver answer is admitted: nothing was judged, and the dialer would resolve the name itself"),
    _m("profile-answers-skipped-in-core", "    if answers is None:\n        return \"\", rule, True\n",
       "    if answers is None or s.kind == \"profile\":\n        return \"\", rule, True\n", "basic", "public-only",
       "the composition skips the resolver answers of profile requests (a private answer, or none at all, is admitted)"),
    # --- destination and rule match ------------------------------------------------------------------------
    _m("http-for-connections", 'CONNECTION_SCHEMES = ("https",)', 'CONNECTION_SCHEMES = ("https", "http")', "basic",
       "credential-scope", "connection traffic may be plain http"),
    _m("scheme-unchecked", '    if o.scheme not in s.schemes:\n        return "scheme-not-allowed"\n', "", "basic", "credential-scope",
       "the scheme is never checked"),
    _m("port-range-unchecked", '    if not 1 <= o.port <= 65535:\n        return "port-invalid"\n', "", "basic", None,
       "a port outside 1-65535 still has to be a declared (host, port), and declared ports are in range"),
    _m("host-error-ignored", "    if o.host_error:\n        return o.host_error\n", "", "basic", None,
       "a refused host reaches the core as the empty name, which no rule or allowlist names"),
    _m("ip-literal-switch-ignored", '        if not s.worker.ip_literals:\n            return "ip-literal-refused"\n', "", "observed",
       "worker-switches", "`ip_literals = false` is ignored (a profile in observe mode reaches `https://10.0.0.1/`)"),
    _m("observe-skips-ip-literals", "        if not s.worker.ip_literals:\n",
       "        if not s.worker.ip_literals and not s.observe:\n", "observed", "worker-switches",
       "a profile in observe mode skips its worker's `ip_literals = false` (it reaches any IP literal)"),
    _m("ip-literal-not-judged", "        reason = judge_address(s.worker, o.ip6, o.ip)", '        reason = ""', "basic", None,
       "`basic` has no profile in observe mode: a literal is refused as no declared host (compiled artifacts declare "
       "names only), and every resolver answer is judged anyway"),
    _m("profile-any-host", "    if (o.host, o.port) not in s.destinations and not s.observe:\n        return s.miss\n", "", "basic", "profile-scope",
       "a destination need not be declared (profiles reach any host)"),
    _m("connect-any-host", "    if (o.host, o.port) not in s.destinations and not s.observe:\n",
       '    if (o.host, o.port) not in s.destinations and not s.observe and s.kind == "profile":\n', "basic", "dns-confined",
       "a connection's destination check is skipped (its requests still need a rule, but a CONNECT to any host is "
       "admitted, and its name resolved before the tunnel's first request is judged)"),
    _m("observe-every-profile", '    observe = prof.enforce == "observe" and prof.trust == "trusted"', "    observe = True or prof.trust",
       "basic", "profile-scope", "every profile in observe mode: an enforced profile reaches any host"),
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
    _m("allowlist-unfiltered", "        headers = frozenset(h.lower() for h in rule.headers if not header_is_denylisted(h, inject, conn.kind))",
       "        headers = frozenset(h.lower() for h in rule.headers)", "basic", None,
       "only an allowlist that names a denylisted header exposes it, and header-safety refutes such an allowlist as declared"),
    _m("allowlist-of-first-rule", "    allow = s.rules[rule].headers", "    allow = s.rules[0].headers", "basic", "header-safety",
       "every rule forwards the first rule's allowlist (`accept` goes out under `issues`, whose allowlist does not name it)"),
    _m("connection-listed-forwarded", "    if listed_in_connection:\n        return False\n", "", "basic", None,
       "a name listed in `Connection` is hop-by-hop hygiene; a denylisted name is dropped anyway"),
    # --- brokering: a profile's requests that carry a connection's credential ---------------------------------
    _m("broker-outside-rules", "        if admits(rule, o) and head_shape(o, i) == \"\":\n            return i\n    return -1",
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
    # --- the abstractions the model keeps: each is enforced, so a core that leaves it is never proved -----------------
    _m("host-dns-suffix", "    return rule.host == o.host and rule.port == o.port and o.method in rule.methods",
       '    return (rule.host == o.host or o.host.endswith("." + rule.host)) and rule.port == o.port and o.method in rule.methods',
       "basic", "credential-scope", "a rule's host matches as a DNS suffix (`x.api.github.com` gets the credential)",
       expect="unknown"),
    _m("profile-host-dns-suffix", "    if (o.host, o.port) not in s.destinations and not s.observe:\n        return s.miss\n",
       '    if (o.host, o.port) not in s.destinations and not s.observe and not o.host.endswith(".pypi.org"):\n        return s.miss\n',
       "basic", "profile-scope", "a profile's allowlist entry matches as a DNS suffix (`evil.pypi.org` is admitted)",
       expect="unknown"),
    _m("method-case-folded", "    return rule.host == o.host and rule.port == o.port and o.method in rule.methods",
       "    return rule.host == o.host and rule.port == o.port and o.method.upper() in rule.methods", "basic",
       "credential-scope", "methods compare case-insensitively (`get`, forwarded as written, gets the credential)",
       expect="unknown"),
    _m("answers-first-three", "    for valid, is6, x in answers:", "    for valid, is6, x in answers[:3]:", "basic", "public-only",
       "only the first three resolver answers are judged (a fourth, private one is dialable)", expect="unknown"),
    _m("answers-counted", "    for valid, is6, x in answers:\n        seen = True\n",
       "    n = 0\n    for valid, is6, x in answers:\n        seen = True\n        n += 1\n        if n > 3:\n            return \"\"\n",
       "basic", "public-only", "the judgement stops admitting after three answers", expect="unknown"),
    _m("within-block-end-open", "        if x >> shift == top:",
       "        if x >> shift == top and x & ((1 << shift) - 1) != (1 << shift) - 1:", "basic", "public-only",
       "the last address of every block is outside it (an interval's end is exclusive: 10.255.255.255 is public)"),
    _m("intervals-blocks-skipped", "            lo += 1 << shift", "            lo += 2 << shift", "basic", "public-only",
       "the blocks of a range skip every other block (half of 100.64.0.0/10 is public)"),
    _m("is-token-anything", '    return name != "" and name.strip(TOKEN_CHARS) == ""', "    return True", "basic", None,
       "header-safety speaks of the denylist and the allowlists, which hold tokens only: a name that is no token "
       "(h11 refuses one; h2 lets `(`, `/`, `@` and the like through) is on neither, and dropping it is hygiene no "
       "property states"),
    _m("x-http-method-forwarded", '        "x-http-method",\n', "", "basic", "header-safety",
       "`x-http-method` is not denylisted (sandbox traffic forwards it: a method override)", DATA),
    # --- the tables, built outside the core -----------------------------------------------------------------
    _m("connection-judged-by-default", "            worker = self._by_name[0].get(conn.worker) if conn is not None else None",
       "            worker = self._by_name[0].get(DEFAULT_WORKER) if conn is not None else None", "workers", "deny-cidrs",
       "a connection's table is built with the `default` worker (its own deny_cidrs ignored)", ADAPTER),
    _m("normalize-prefix-drops-last-segment", '    return norm.rstrip("/") or "/"',
       '    return norm.rstrip("/").rsplit("/", 1)[0] or "/"', "basic", "credential-scope",
       "a rule's prefix loses its last segment (`/repos/acme` admits all of `/repos`)", NORMALIZE),
    # --- the adapter and the edge, outside the proof: the test suite must fail --------------------------------
    _suite("profile-answers-skipped", ADAPTER,
           "    reason, rule, admitted = core.verdict(s, o, answers_of(ips) if ips is not None else None)",
           '    reason, rule, admitted = core.verdict(s, o, answers_of(ips) if ips is not None and s.kind == "connection" else None)',
           "the composition skips the resolver answers of profile requests (a private answer is dialled)",
           "tests/egress_proxy/decision/test_adapter.py"),
    _suite("every-header-forwarded", ADAPTER,
           "    forward = tuple(h for h, lower in zip(req.headers, lowers) if core.forwarded(s, rule, lower, lower in hop))",
           "    forward = tuple(req.headers)", "the adapter forwards every caller header, the core's answer ignored",
           "tests/egress_proxy/decision/test_adapter.py"),
    # --- credential kinds: the token endpoint, the edge's own call ------------------------------------
    _m("minted-raw-string-prefix", '    return prefix == "/" or path == prefix or path.startswith(prefix + "/")',
       '    return prefix == "/" or path.startswith(prefix)', "minted", "credential-scope",
       "the same raw-string prefix, on a minting connection: its minted token rides `/drive/v3x`, outside its rules"),
    _m("mint-answers-unjudged", "    return answers_verdict(s.worker, answers)\n", '    return ""\n', "minted", "public-only",
       "a token endpoint is dialled whatever it resolves to (a private or metadata address included)"),
    _m("token-endpoint-default-worker",
       '        return self.view(Lease(subject="", profile=None, connection=connection, exp=0))[0]\n',
       '        view, judge = self.view(Lease(subject="", profile=None, connection=connection, exp=0))[0], self.judge(DEFAULT_WORKER)\n'
       '        return View(__import__("dataclasses").replace(view.subject, worker=judge.tables), judge, {}) if view and judge else view\n',
       "minted", "deny-cidrs", "the token endpoint's answers are judged by the `default` worker, not the connection's "
       "(`8.8.8.8`, in worker `edge`'s deny_cidrs, is dialled for a mint)", ADAPTER),
    _suite("mint-endpoint-not-vetted", ATTACH, "            if not judged.allowed:\n                call.answer_reason",
           "            if False:\n                call.answer_reason",
           "the edge dials the token endpoint without the worker's judgement of its answers",
           "tests/egress_proxy/edge/test_attach.py::test_a_token_endpoint_that_resolves_to_a_private_address_is_never_dialled_and_its_mint_is_audited",
           "tests/credentials/test_minted.py::test_a_token_endpoint_that_resolves_to_a_private_address_is_never_dialled"),
    _suite("mint-not-single-flight", BROKER, "        running = self._inflight.get(address)\n", "        running = None\n",
           "every request waiting for a token mints its own (N concurrent requests, N calls to the token endpoint)",
           "tests/credentials/test_minted.py::test_oauth2_tokens_are_refreshed_for_ten_seconds_one_mint_at_a_time"),
    _suite("signing-header-of-the-client", SIGV4_KIND,
           "            if unsigned:\n                payload = sigv4.STREAMING_UNSIGNED_TRAILER if client == sigv4.STREAMING_UNSIGNED_TRAILER else sigv4.UNSIGNED_PAYLOAD\n",
           "            if unsigned:\n                payload = client or sigv4.UNSIGNED_PAYLOAD\n",
           "the edge signs whatever payload hash the sandbox declared",
           "tests/credentials/test_minted.py::test_a_client_signing_header_is_never_forwarded"),
    _suite("lease-not-bound", BINDING, "            client.bound = client.bound or claim\n",
           "            client.bound = claim\n",
           "a client connection is no longer bound to its first lease (another subject's lease is accepted on it)",
           "tests/clients/test_lease_proxy.py"),
    # --- request shapes (egress_proxy/decision/shapes.py, and the core's use of their verdict) ------------------
    _m("shapes-batch-first-only", "    for i, message in enumerate(messages):\n        kind, method, tool, arguments = message\n",
       "    for i, message in enumerate(messages[:1]):\n        kind, method, tool, arguments = message\n", "shaped",
       "shape-confined", "an MCP batch is judged by its first message only (a second message calls any tool)", SHAPES),
    _m("shapes-additional-ignored", '            if not tool.additional:\n                return "mcp-argument-refused", '
       'f"path=$.{shown(key)}: not an allowed argument"\n', "            pass\n", "shaped", "shape-confined",
       "a tool's `additional = false` is ignored (any unlisted argument key is admitted)", SHAPES),
    _m("shapes-enum-loose", "        if type(e) is type(x) and e == x:\n", "        if e == x:\n", "shaped", "shape-confined",
       "enum values compare loosely (`true` is admitted where the enum lists `1`)", SHAPES),
    _m("shapes-ref-star-crosses-slash", '    escaped = "[^/]*".join(', '    escaped = ".*".join(', "shaped", "shape-confined",
       "`*` in a push pattern crosses `/` (`refs/heads/agent/*` admits `refs/heads/agent/x/main`)", SHAPES),
    _m("shapes-template-count-ignored", '    if len(segments) != len(template):\n        return "path-template-mismatch", '
       'f"{len(segments)} segments, the template has {len(template)}"\n', "", "shaped", "shape-confined",
       "a path's segment count is not checked against its template (a longer path is admitted)", SHAPES),
    _m("shapes-query-repeat-ignored", '        for j in range(i):\n            if pairs[j][0] == name:\n'
       '                return "query-parameter-repeated", f"name={shown(name)}"\n', "", "shaped", "shape-confined",
       "a query parameter given twice is admitted (parameter pollution)", SHAPES),
    _m("core-head-shape-ignored", '            shaped = head_shape(o, i)\n', '            shaped = ""\n', "shaped", "shape-gate",
       "the core admits under a rule whatever its head shapes say"),
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
    if name == "shaped":
        from compiler.artifact import Git, GraphQL, Mcp, Param, Segment, Tool, Value

        get_issue = Tool(name="get_issue", arguments=(Param(name="number", value=Value(type="integer", minimum=1)),
                                                      Param(name="repo", value=Value(enum=("acme/app", "acme/web")))),
                         required=("number", "repo"))
        search = Tool(name="search", arguments=(Param(name="q", value=Value(pattern="[a-z0-9 ]+", max_length=64)),
                                                Param(name="level", value=Value(type="any", enum=(1, "x")))))
        template = (Segment(literal="repos"), Segment(name="owner", value=Value(enum=("acme",))),
                    Segment(name="repo", value=Value(enum=("app", "web"))), Segment(literal="issues"),
                    Segment(name="number", value=Value(type="integer", minimum=1, maximum=1000000)))
        issues = rule("issues", "api.example.com", "/repos", ["GET"], ["accept"]).model_copy(update={
            "template": template, "query": (Param(name="state", value=Value(enum=("closed", "open"))),)})
        tools = rule("tools", "mcp.example.com", "/mcp", ["POST"], ["content-type"]).model_copy(update={
            "mcp": Mcp(methods=("initialize", "tools/call", "tools/list"), tools=(get_issue, search))})
        graph = rule("graph", "graphql.example.com", "/graphql", ["POST"], ["content-type"]).model_copy(update={
            "graphql": GraphQL(query=("repository", "viewer"))})
        push = rule("push", "github.com", "/acme/app.git", ["GET", "POST"], ["content-type"]).model_copy(update={
            "git": Git(fetch=True, push=("refs/heads/agent/*",), create=True)})
        return artifact(connections=[connection("shaped", [issues, tools, graph, push])],
                        profiles=[profile("ci", [("mcp.example.com", 443)], brokers=("shaped",))]).to_json()
    if name == "minted":
        from tests.egress_proxy.builders import oauth2, sigv4

        return artifact(
            connections=[
                connection("drive", [rule("files", "www.googleapis.com", "/drive/v3", ["GET"], ["accept"])], worker="edge",
                           mint=oauth2("https://oauth2.googleapis.com/token")),
                connection("artifacts", [rule("bucket", "s3.us-east-1.amazonaws.com", "/acme-artifacts", ["GET", "PUT"],
                                              ["content-type"])], inject_format="{secret}", mint=sigv4()),
            ],
            workers=[worker("edge", deny_cidrs=("8.8.8.0/24",))],
        ).to_json()
    if name == "observed":  # a profile in observe mode (it reaches any host) on a default worker with ip_literals = false
        watch = profile("watch", [("pypi.org", 443)]).model_copy(update={"enforce": "observe"})
        return artifact(connections=[connection("github", [rule("read", "api.github.com", "/repos/acme")])],
                        profiles=[watch]).to_json()
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
    from egress_proxy.decision.adapter import decide, decide_connect, judge_body, judge_token_answers
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
            request = request_from_dict(cex["request"])
            if r["property"] == "dns-confined":  # admitted before any address: what a front end decides before it resolves
                connect = (cex.get("extra") or {}).get("connect")
                d = (decide_connect(art, lease, connect, request.headers, request.has_body) if connect is not None
                     else decide(art, lease, request, None))
                out[key] = decision_dict(d)
                continue
            d = decide(art, lease, request, cex["resolved_ips"])
            body = (cex.get("extra") or {}).get("body")
            if body is not None and d.allowed and d.body_shape is not None:  # a request shape's body: judged whole
                d = judge_body(art, lease, request, d, body.encode("utf-8"))
            out[key] = decision_dict(d)
        elif (cex.get("extra") or {}).get("token_endpoint"):  # a minting connection's token endpoint, as the edge judges it
            out[key] = decision_dict(judge_token_answers(art, name, cex["resolved_ips"]))
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
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["prove", artifact_path, "-o", out_path, "--format", "json"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except Exception:  # prove itself crashed: say so (exit 1 would read as `refuted`)
        import traceback

        sys.stderr.write(err.getvalue())
        traceback.print_exc()
        return CRASHED
    if TRACEBACK in err.getvalue():
        sys.stderr.write(err.getvalue())
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
    ok: bool  # refuted as expected (breaking) / unchanged (equivalent); never when crashed
    detail: str
    crashed: bool = False  # prove (or the child) crashed: a failure, whatever the mutant's kind


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
    if not out.exists():  # the prover failed outright: a mutant it could not judge is not refuted
        return proc.returncode, {"results": [], "mutant_replays": {}, "error": proc.stderr[-2000:], "stderr": proc.stderr[-2000:]}
    try:
        doc = json.loads(out.read_text())
    except ValueError:
        doc = {"results": [], "mutant_replays": {}, "error": "the report is not JSON"}
    doc["stderr"] = proc.stderr[-2000:]
    return proc.returncode, doc


def crash(code: int, doc: dict) -> str | None:
    """Why a child's run of `prove` is a crash (None: it is not): an exit code other than 0/1/4, or a traceback."""
    text = doc.get("stderr") or doc.get("error") or ""
    last = next((ln.strip() for ln in reversed(text.strip().splitlines()) if ln.strip()), "")
    if code == CRASHED or TRACEBACK in text:
        return f"prove raised (exit {code}): {last or 'no message'}"
    if code not in PROVE_EXITS:
        return f"prove exited {code}" + (f": {last}" if last else "")
    return None


def judge(mutant: Mutant, code: int, doc: dict, base: dict, artifact_text: str) -> Outcome:
    """Compare a mutant's report with the baseline (and its replays with the real code's); a crash fails it."""
    crashed = crash(code, doc)
    if crashed is not None:
        return Outcome(mutant, code, False, f"CRASHED: {crashed}", crashed=True)
    verdicts = {(r["worker"], r["subject"], r["property"]): r for r in doc["results"]}
    if mutant.expect == "unknown":
        unknown = [f"{k[1]}: {r['detail']}" for k, r in sorted(verdicts.items()) if k[2] == mutant.breaks
                   and r["verdict"] == "unknown" and "cannot be evaluated symbolically" in r["detail"]]
        if code == 4 and unknown:
            return Outcome(mutant, code, True, f"unknown (exit 4) {unknown[0]}")
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


def run_suite(mutant: Mutant, workdir: Path) -> Outcome:
    """A suite mutant: its tests, with the mutant installed in every Python process they start, must fail."""
    hook = workdir / f"hook-{mutant.id}"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tests.proofs.mutants import MUTANTS, install\n"
        "install(next(m for m in MUTANTS if m.id == os.environ['EGRESSLAW_MUTANT']))\n")
    env = dict(os.environ, EGRESSLAW_MUTANT=mutant.id, PYTHONPATH=os.pathsep.join([str(hook), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *mutant.tests], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED") or " passed" in ln or " failed" in ln]
    shown = lines[0] if lines else proc.stdout.strip().splitlines()[-1:] or [proc.stderr[-200:]]
    return Outcome(mutant, proc.returncode, proc.returncode == 1, str(shown if isinstance(shown, str) else shown[0]))


def evaluate(mutants, jobs: int = 2, progress=None) -> list[Outcome]:
    """Run every mutant in its own process (`jobs` at a time) against its artifact; outcomes in `mutants` order."""
    with tempfile.TemporaryDirectory(prefix="egresslaw-mutants-") as tmp:
        workdir = Path(tmp)
        bases = {name: baseline(name, workdir) for name in sorted({m.artifact for m in mutants if m.expect != "suite"})}
        texts = {name: path.read_text() for name, (path, _, _) in bases.items()}

        def one(m: Mutant) -> Outcome:
            if m.expect == "suite":
                outcome = run_suite(m, workdir)
                if progress:
                    progress(outcome)
                return outcome
            code, doc = run_child(m, bases[m.artifact][0], workdir)
            outcome = judge(m, code, doc, bases[m.artifact][1], texts[m.artifact])
            if progress:
                progress(outcome)
            return outcome

        with cf.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return list(pool.map(one, mutants))


def render_markdown() -> str:
    """The mutant list of docs/proofs.md (a test keeps it current)."""
    lines = ["| mutant | planted bug | caught by (or why it is equivalent) |", "|---|---|---|"]
    for m in MUTANTS:
        if m.breaks:
            where = "" if m.module in (CORE, DATA) else f" (in `{m.module}`)"
            caught = {"refuted": f"`{m.breaks}` refuted", "unknown": f"`{m.breaks}`: exit 4, the operation named",
                      "suite": f"the tests `{'`, `'.join(m.tests)}` fail"}[m.expect]
            lines.append(f"| `{m.id}` | {m.why}{where} | {caught} |")
    for m in MUTANTS:
        if not m.breaks:
            lines.append(f"| `{m.id}` | {m.replacement.strip() and 'changed' or 'removed'}: `{m.original.strip().splitlines()[0]}` | equivalent: {m.why} |")
    return "\n".join(lines) + "\n"


def score_line(outcomes: list[Outcome]) -> str:
    breaking = [o for o in outcomes if o.mutant.breaks is not None]
    caught = sum(o.ok for o in breaking)
    kinds = {k: sum(o.ok for o in breaking if o.mutant.expect == k) for k in ("refuted", "unknown", "suite")}
    return (f"mutation score: {caught}/{len(breaking)} property-breaking mutants caught ({kinds['refuted']} refuted by "
            f"prove, {kinds['unknown']} unknown with the operation named, {kinds['suite']} failing the tests; "
            f"{len(outcomes)} mutants, {len(outcomes) - len(breaking)} equivalent)")


def run(mutant_id: str, args: list[str]) -> int:
    """The real CLI with one mutant installed (the gate's test of a stale report)."""
    install(next(m for m in MUTANTS if m.id == mutant_id))
    from egresslaw.cli import main

    return main(args)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        sys.exit(child(*sys.argv[2:]))
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3:]))
    sys.exit("usage: python -m tests.proofs.mutants child MUTANT ARTIFACT OUT (bench/mutants.py runs the whole set)")
