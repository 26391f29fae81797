"""One statement of each property, and of what "proved" covers: the data the report, the gate and the docs share.

`docs/proofs.md` and docs/walkthrough.md embed `render_properties()` and `render_scope()` verbatim between
markers (a test checks they are current). No z3 here: the proxy's start gate imports this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Statement:
    id: str
    text: str  # the property, as proved
    subjects: str  # what it is checked for
    source: str  # what the independent statement (`proofs/spec/`) is written from
    example: str  # what a counterexample looks like


STATEMENTS: tuple[Statement, ...] = (
    Statement(
        "vacuity",
        "each worker may dial at least one address and each subject admits at least one request, on at least one judged "
        "resolver answer (otherwise every other proof about it would hold trivially); and each path template, MCP tool, "
        "GraphQL root field and git push pattern of a connection's rules admits at least one request the real judge "
        "admits (replayed)",
        "every worker and subject",
        "the core itself (a witness request or address), and the shape judges (`egress_proxy/decision/shapes.py`)",
        'connection "x" admits no request at all',
    ),
    Statement(
        "public-only",
        "an admitted request was judged on at least one resolver answer (with none, the dialer would resolve the name "
        "itself, unjudged), and every resolver answer of it (every one: the dialer may use any) is public for the worker that "
        "judges it (a connection's, also for the requests a profile brokers to it; else `default`): neither the address "
        "nor any IPv4 address it carries (IPv4-mapped/compatible, NAT64 well-known, local-use and the worker's prefixes, "
        "6to4, Teredo, ISATAP) is in the catalog's special-purpose table; `allow_cidrs` holes count as violations; and every "
        "answer the edge may dial for a minting connection's token endpoint (`core.mint_verdict`), judged by that "
        "connection's declared worker (at least one)",
        "every worker and subject",
        "the catalog's table and the RFCs' embedded-IPv4 forms (RFC 4291, 6052, 8215, 3056, 4380, 5214)",
        'worker "edge": allow_cidrs admits 100.64.0.1 (shared address space, RFC 6598)',
    ),
    Statement(
        "deny-cidrs",
        "an admitted request was judged on at least one resolver answer, none of which is in the judging worker's "
        "`deny_cidrs` or carries an IPv4 address that is, and with `ipv6 = false` none is IPv6; the same for the answers of a "
        "minting connection's token endpoint",
        "every worker and subject",
        "the worker's settings as declared and the same RFC forms",
        'worker "edge": 2002:cb00:71ff::1 admitted, it carries 203.0.113.255 (deny_cidrs 203.0.113.0/24)',
    ),
    Statement(
        "worker-switches",
        "every admitted request obeys the switches of the worker that judges it as declared (as for the answers), for "
        "every subject, a profile in observe mode included: with `ip_literals = false` its host is never an IP literal; "
        "an IP-literal host is itself public (`allow_cidrs` holes count as violations), neither it nor an IPv4 address "
        "it carries is in `deny_cidrs`, and it is IPv4 when `ipv6 = false`; its resolver answers obey the same switches "
        "(public-only, deny-cidrs)",
        "every connection and profile",
        "the worker's `ip_literals`, `ipv6`, `allow_cidrs` and `deny_cidrs` as declared, and public-only's statement",
        'profile "ci" (observe mode): GET https://10.0.0.1/ is admitted, an IP-literal host worker "default" refuses: ip_literals = false',
    ),
    Statement(
        "no-redirect",
        "no upstream request is ever issued except the one the caller sent: over any answer status, a 3xx never makes "
        "the worker issue another request",
        "every worker and subject",
        "no follow-up request at all",
        'worker "legacy": 302 Location: http://169.254.169.254/ → second request issued (follow_redirects = true)',
    ),
    Statement(
        "credential-scope",
        "a connection's credential is attached only to requests that are https and match the rule the decision names, "
        "as declared: exact host and port, one of its methods, the normalized path equal to its prefix or below it "
        "(segment-bounded); a sandbox profile's requests carry only the credential of a connection it lists in "
        "`brokers`, under such a rule of that connection; for every credential kind (a static value, a minted OAuth 2.0 "
        "or GitHub App token, a SigV4 signature: the kind changes what is attached, never where)",
        "every connection and every profile that brokers one",
        "the connection's rules and the profile's `brokers` as declared in the artifact",
        'GET https://api.github.com/repos/acmex gets the credential under rule "read-repos" (prefix matched as a raw string)',
    ),
    Statement(
        "profile-scope",
        "sandbox traffic reaches only its profile's exact `host:port` allowlist as declared, over http or https "
        "(nothing when its network is `none`); a profile declared `enforce = \"observe\"` (trusted, with a network, "
        "brokering nothing) may reach any host and port, still judged by its worker and carrying no credential",
        "every profile",
        "the profile's allowlist as declared in the artifact",
        'profile "ci" admits GET https://evil.example.net/, outside its allowlist',
    ),
    Statement(
        "dns-confined",
        "a front end resolves a name only for a request the core admitted before any address (`core.request_verdict` for "
        "a request, `core.connect_verdict` for a CONNECT: a refused one resolves nothing, `egress_proxy/front/admit.py`), "
        "and that name at its port is one of the subject's own destinations as declared: a rule's `host:port` of a "
        "connection, an allowlist `host:port` of a profile (its brokered rules add none; nothing with network `none`), "
        "so a resolver's query carries nothing the workload chose but which declared destination; a profile in observe "
        "mode resolves the names it observes, any `host:port`: DNS is not confined for it, and the statement is only that "
        "a name outside its allowlist is resolved as observed (`would-deny`). A minting connection's token endpoint is the "
        "artifact's `mint.token_host`, which no request names (the edge reads it from the artifact, outside the core)",
        "every connection and profile",
        "the rules and allowlists as declared in the artifact (`proofs/spec/resolution.py`)",
        'connection "github": `CONNECT evil.example.net:443` is admitted before any address, so `evil.example.net` is resolved',
    ),
    Statement(
        "header-safety",
        "for every header name (any HTTP token), no caller header on the SPEC denylist (routing, hop-by-hop, "
        "authorization, `proxy-*`, `x-forwarded-*`), equal to the credential header or written by the credential's kind at "
        "the edge (SigV4's `x-amz-date`, `x-amz-security-token`, `x-amz-content-sha256`) is ever forwarded, no allowlist "
        "asks for one, connection and brokered traffic forwards only names on the declared allowlist of the rule the "
        "decision names, and the credential rides in exactly its connection's declared header (never one for plain "
        "profile traffic)",
        "every connection and profile",
        "SPEC section 2.1's denylist, transcribed in `proofs/spec/requests.py`, and the rules as declared",
        'connection "x": header "X-Forwarded-Host" forwarded',
    ),
    Statement(
        "trust-lane",
        "every adversarial profile has no network, or an allowlist on a provider certified `security_boundary` with "
        "every enforcement axis, and brokers no credential; no profile in observe mode is adversarial or brokers one",
        "every profile",
        "the profile and its provider as declared",
        'profile "build": adversarial with advisory_filter provider and allowlist egress',
    ),
    Statement(
        "shape-gate",
        "a request is admitted under a rule only when that rule's head shapes (path template, query, header values, "
        "git's service) admit it: the core never admits under, nor falls through to, a rule whose head shape refused, for "
        "any verdict of the shapes; and a POST admitted under a rule with an MCP, GraphQL or git push body shape is "
        "handed to the edge to judge its body (`Decision.body_shape`, checked on a replayed witness per rule)",
        "every connection and profile with a rule that has a request shape",
        "the core itself, with each shape's verdict a free input",
        'connection "tools": `GET https://mcp.example.com/x` admitted under rule "tools", whose template refuses it',
    ),
    Statement(
        "shape-confined",
        "nothing a rule's shape judges admit lies outside the shape as declared (docs/shapes.md): a path outside its "
        "template, a query parameter it does not list, given twice or with a value outside its constraint, a header "
        "value outside its constraint or given twice, an MCP message with an unlisted method, a call to an unlisted tool, "
        "an argument key unlisted, missing when required or present when forbidden, a value outside its constraint, a "
        "GraphQL operation type or root field it does not list, an unlisted persisted hash, a push to a ref no pattern "
        "matches, a creation or deletion it does not allow; over the modelled inputs (docs/proofs.md, \"Request "
        "shapes\"), each counterexample replayed through `decide` and `adapter.judge_body`",
        "every connection with a rule that has a request shape",
        "the rule's shapes as declared in the artifact (`proofs/spec/shapes.py`)",
        'rule "tools" admits body `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"delete_repo",...}}`',
    ),
    Statement(
        "no-widening",
        "(with `--against` an old artifact or the lock) no request is admitted by the new version and denied by the old, "
        "and none gets a credential the old did not attach to it (adding a broker is a widening); a rule whose shape "
        "changed must admit nothing (head or body) the old same-named rule refuses",
        "subjects in both artifacts",
        "the previous artifact, run through the same core",
        'POST https://api.x.com/v2/admin: old DENY (path-not-allowed), new ALLOW (rule "admin")',
    ),
    Statement(
        "within",
        "(with `--within` a ceiling policy or artifact) every request a subject admits is admitted by the ceiling's "
        "same-named subject (or the one `--map` names), with the resolver answers it was admitted with (so its worker is "
        "at least as strict where it matters), and it carries no credential the ceiling does not attach to it; a rule whose "
        "shape differs from the ceiling's same-named rule admits nothing (head or body) that rule refuses",
        "every subject (one the ceiling lacks admits nothing under it)",
        "the ceiling artifact an operator owns, run through the same core",
        '`GET https://pypi.org/simple/x`: ceiling DENY (host-not-allowed), candidate ALLOW',
    ),
)

PROPERTIES: dict[str, str] = {s.id: s.text for s in STATEMENTS}
WORKER_PROPERTIES = ("vacuity", "public-only", "deny-cidrs", "no-redirect")
CONNECTION_PROPERTIES = WORKER_PROPERTIES + ("worker-switches", "header-safety", "credential-scope", "dns-confined")
PROFILE_PROPERTIES = WORKER_PROPERTIES + ("worker-switches", "header-safety", "profile-scope", "trust-lane", "dns-confined")
BROKER_PROPERTIES = ("credential-scope",)  # also checked for a profile that brokers a connection
SHAPE_PROPERTIES = ("shape-gate", "shape-confined")  # also checked for a connection with a shaped rule
BROKERED_SHAPE_PROPERTIES = ("shape-gate",)  # and for a profile that brokers one

# What a proof is about, and what it is not (rendered into the docs). Every abstraction the model keeps says how the
# prover checks that the core respects it.
COVERS = (
    "the decision code exactly as the proxy runs it: the prover evaluates the source of `egress_proxy/decision/core.py` "
    "(and the data it reads from `compiler/constants.py`) symbolically, `within` and `is_token` included (there is no "
    "second, symbolic implementation of anything), on the subject tables the proxy's own index builds; the report's "
    "digest covers every module a proof depends on (the whole `egress_proxy/decision/` package: core, adapter, "
    "composition, table builders; `compiler/normalize.py`, `compiler/constants.py`, `compiler/artifact.py`, `catalog/`), "
    "and the proxy refuses a report made from other code, edited (its summary disagrees with its results) or not "
    "signed by the trusted key",
    "every request the core can be handed: any scheme and port; any host, modelled as each exact host of the "
    "subject's rules, allowlist and tables, any other name, or any IP literal (its own 128-bit address) — exact "
    "because the core may only compare a host for equality with those hosts: the evaluator refuses (`unknown`, "
    "naming the operation) a suffix, substring, case-folded or ordering test, a length, an index, a hash or a "
    "constant no table holds; any method, the same way (`METHODS`, the rules' methods, any other); any normalized "
    "path, one witness per class of the partition by the rules' prefixes (exact for equality and `startswith` with "
    "those prefixes, any other path operation refused); any outcome of the header scan; any header name (a Z3 "
    "string over every lowercase HTTP token)",
    "resolver answer lists of any length: the evaluator accepts only a `for` over the whole list whose body carries "
    "nothing from one answer to the next but flags set to one constant — then the outcome on any list is the outcome "
    "on an ordered sub-list of at most flags + 2 answers — and refuses slicing, indexing, `len`, counters and values "
    "read after the loop; the model has three answer slots, each present or not, and refuses a core whose loops "
    "would need more",
    "request shapes (`shape-confined`, the shape part of `vacuity`): the judges of `egress_proxy/decision/shapes.py` "
    "evaluated from their source on symbolic parsed values: texts as Z3 strings over the characters the adapter can hand "
    "them, integers as Z3 integers, names as each listed name or one standing for any other (compared for equality "
    "only), an MCP tool's arguments as every key any tool names plus any other, each present or not, of any JSON type; "
    "primitives for `type`, `len` and `int` of those values, `dict.get` by equality, and one for "
    "`compiler.patterns.matches`: the pattern's AST translated to a Z3 regular expression (`proofs/regex.py`; a "
    "hypothesis test holds it equal to Python's matcher on random patterns and strings; Z3's characters stop at "
    "U+2FFFF); the inputs are bounded: the template's segment count and one either side, up to 2 query pairs and 2 "
    "listed header values, an MCP batch of up to 2 messages, a GraphQL batch of up to 2 requests of 2 root fields each, "
    "a push of up to 2 updates (sha1 or sha256 ids, zero or not); a GraphQL document is its operation type and root fields, and which "
    "persisted hash it has is free (every outcome covered); a construct the evaluator cannot run is `unknown`, named",
    "statements that read the artifact as declared (rules, allowlists, `brokers`, the worker each subject names and "
    "its `deny_cidrs`, `ipv6` and `nat64_prefixes`) and SPEC's header denylist (a test holds it equal to the code's, "
    "both ways), never a table the code under proof built: a table built wrongly is refuted",
)
NOT_COVERED = (
    "mitmproxy's own HTTP parsing and its choice of what reaches the hooks (the conformance corpus tests it)",
    "the adapter that reads a request into the core's inputs: host and path normalizers, the header scan, the "
    "`Host` agreement, and how it hands the core's verdict on (in the proof as free inputs: any outcome is covered, "
    "its correctness is tested; seeded bugs there must fail the test suite, `bench/mutants.py`)",
    "the addon's handling around the decision: lease verification and the binding of a client connection to its "
    "first lease, custody, header rewriting, response scanning, pinning the vetted address, audit (tested the same way)",
    "what a credential kind computes (egress_proxy/credentials: the OAuth 2.0 and GitHub App token requests, the "
    "SigV4 signature, the token cache) and the edge's call to a token endpoint beyond the judgement of its answers "
    "(TLS for its name, no redirect followed, the reply never relayed): tested against independent stand-ins and "
    "botocore's signer",
    "how the adapter reads a request into the shape judges' inputs (the path's segments, the decoded query, the bodies "
    "`egress_proxy/decision/bodies.py` parses), which rules it asks (`adapter._head_shapes`) and git's service "
    "(`shapes.git_service`): tested (tests/egress_proxy/decision/test_shapes.py, tests/shapes/); the core's properties "
    "hold for any verdict of the shapes, and `shape-gate` ties the core to them",
    "DNS itself, TLS and certificate verification, the kernel",
)


def render_properties() -> str:
    """The property table of docs/proofs.md and docs/walkthrough.md."""
    lines = ["| id | proved statement | checked for | stated independently from | counterexample looks like |",
             "|---|---|---|---|---|"]
    for s in STATEMENTS:
        lines.append(f"| `{s.id}` | {s.text} | {s.subjects} | {s.source} | `{s.example}` |")
    return "\n".join(lines) + "\n"


def render_scope() -> str:
    """What "proved" covers and what it does not, as two bullet lists."""
    out = ["\"Proved\" covers:", ""] + [f"- {c}" for c in COVERS]
    out += ["", "It does not cover:", ""] + [f"- {c}" for c in NOT_COVERED]
    return "\n".join(out) + "\n"
