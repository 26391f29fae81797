"""Every compiler diagnostic code, as data: stable ids, a short name and a one-line description.

Codes are never renumbered or reused; the table in docs/language.md is generated from this tuple.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Code:
    id: str
    name: str
    summary: str


CODES: tuple[Code, ...] = (
    Code("EL0001", "syntax", "the file does not parse"),
    Code("EL0002", "language-version", "missing or unsupported `egresslaw N` header"),
    Code("EL0003", "workspace", "a policy needs exactly one `workspace`"),
    Code("EL0004", "catalog", "a policy needs exactly one `catalog`"),
    Code("EL0005", "catalog-version", "the pinned catalog version is not published"),
    Code("EL0006", "duplicate-name", "a name is declared twice (names are unique across the policy)"),
    Code("EL0007", "unknown-key", "a key that this block does not accept"),
    Code("EL0008", "wrong-type", "a value of the wrong type"),
    Code("EL0009", "missing-key", "a required key is absent"),
    Code("EL0010", "host-wildcard", "a wildcard host; only exact hosts are allowed"),
    Code("EL0011", "host-not-bare", "a host with a scheme, userinfo, path or malformed port"),
    Code("EL0012", "host-ip-literal", "an IP literal (in any notation) where a host name is required"),
    Code("EL0013", "host-special-use", "a special-use or internal name (`localhost`, `*.internal`, `metadata`, …)"),
    Code("EL0014", "host-syntax", "a host that is not a valid FQDN after IDNA mapping"),
    Code("EL0015", "network-unrestricted", "a network of type `unrestricted`"),
    Code("EL0016", "network-type", "an unknown network type or a malformed network object"),
    Code("EL0017", "mcp-only", "`allow_mcp_servers` is the only grant: an allowlist has to name somewhere to reach"),
    Code("EL0018", "certification", "`security_boundary` demanded of a provider revision that does not advertise it"),
    Code("EL0019", "trust-lane", "an adversarial profile without every enforcement axis or with uncertified allowlist egress"),
    Code("EL0020", "unknown-provider", "a provider `name@revision` the catalog does not list"),
    Code("EL0021", "bad-enum", "a value outside its allowed set (trust, certification, ecosystem, ...)"),
    Code("EL0022", "rule-count", "a connection needs 1 to 32 egress rules"),
    Code("EL0023", "port-range", "a port outside 1-65535, or a number out of range"),
    Code("EL0024", "path-prefix", "a path prefix that is not absolute and normalized"),
    Code("EL0025", "method", "an unknown, wildcard or forbidden method (CONNECT, TRACE), or none"),
    Code("EL0026", "header-denylisted", "a routing- or authorization-bearing header in an allowlist"),
    Code("EL0027", "inject-format", "`inject.format` must contain `{secret}` exactly once"),
    Code("EL0028", "inject-header", "`inject.header` is not a valid token or is a routing header"),
    Code("EL0029", "secret-literal", "a string that looks like a secret; reference credentials by custody handle"),
    Code("EL0030", "dangling-reference", "a reference to a worker or connection that is not declared"),
    Code("EL0031", "cidr", "a malformed CIDR in a worker"),
    Code("EL0032", "duplicate-key", "a key given twice in one block or object"),
    Code("EL0033", "bad-name", "a declaration name that is not a simple identifier"),
    Code("EL0034", "header-syntax", "a header name that is not an HTTP token"),
    Code("EL0035", "io", "a policy path that cannot be read"),
    Code("EL0036", "lock", "a malformed `egresslaw.lock`"),
    Code("EL0037", "widening", "a change that widens a published profile or connection without `--allow-widening`"),
    Code("EL0038", "lock-drift", "`compile --locked`: a profile or connection differs from its published version in the lock"),
    Code("EL0039", "adversarial-broker", "an adversarial profile brokers a credential (the adversary could use it)"),
    Code("EL0040", "broker-host-not-allowed", "a brokered connection reaches a host:port the profile's allowlist does not list"),
    Code("EL0041", "credential-kind", "an unknown credential kind, settings of another kind, or a malformed setting of one"),
    Code("EL0042", "token-endpoint", "a token endpoint that is not an exact https URL (or not the kind's endpoint)"),
    Code("EL0043", "observe-refused", "observe mode on a profile that is adversarial, brokers a connection or has no network"),
    Code("EL0044", "template", "a path template that does not parse, is not in normal form, or stands beside `path_prefix`"),
    Code("EL0045", "pattern", "a pattern outside the subset (anchors, backreferences, lookaround, nested quantifiers, ...)"),
    Code("EL0046", "value-constraint", "a value constraint that cannot hold or does not fit its type or place"),
    Code("EL0047", "shape", "a malformed `mcp`, `graphql` or `git` shape, or one its rule cannot carry"),
    Code("EL0048", "header-value-unlisted", "`header_values` for a header the rule's `headers` does not list, or one the edge owns"),
    Code("EL0049", "budget", "a malformed `budget`: an unknown key, a cap below 1, no cap, or a window outside 1 s to 30 days"),
    Code("W0001", "empty-network", "a limited network that reaches nothing; write `{\"type\": \"none\"}`"),
    Code("W0002", "duplicate-entry", "the same host:port, or brokered connection, listed twice"),
)

BY_ID = {c.id: c for c in CODES}
