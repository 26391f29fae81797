"""Every denial reason code, as data in one place: code -> one-line description.

The proxy answers a denial with `X-Egresslaw-Deny: <code>`, the audit log records it, metrics count
by it and the prover's counterexamples name it. Codes are stable: add new ones, never rename.
"""

from __future__ import annotations

# The reason of an allowed decision (not a denial; kept out of REASONS on purpose).
ALLOWED = "allowed"

REASONS: dict[str, str] = {
    # --- the default: a Decision that nobody filled in -------------------------------------------
    "default-deny": "no check admitted the request (a decision starts denied)",
    # --- lease (proxy side: who is asking) --------------------------------------------------------
    "lease-missing": "no lease offered: no `Proxy-Authorization`, or one with empty credentials (`Bearer` or `Basic`)",
    "lease-malformed": "a `Proxy-Authorization` that carries no lease token: another scheme, `Basic` that is not base64 of `user:password`, a value not shaped like a lease, or two headers",
    "lease-invalid": "a lease token whose signature does not verify, or whose signed claims are malformed",
    "lease-key-unknown": "the lease's key id is not in the proxy's lease key set (or the lease has none: an `el1` lease minted before key ids)",
    "lease-key-retired": "the lease's key was rotated out (`keys rotate --lease`) and its overlap window has ended",
    "lease-expired": "the lease is past its `exp`",
    "lease-unknown-subject": "the lease names a profile or connection the artifact does not contain",
    "lease-mismatch": "the client connection is bound to the lease of its first request and this request offers another (the connection is closed)",
    # --- tunnel and protocol (proxy side) ---------------------------------------------------------
    "sni-mismatch": "the TLS SNI differs from the CONNECT host",
    "sni-missing": "the TLS client hello carries no SNI",
    "ech-refused": "the TLS client hello uses encrypted client hello, so the SNI cannot be judged",
    "non-http-in-tunnel": "non-HTTP bytes inside a CONNECT tunnel",
    "connect-in-tunnel": "a CONNECT request inside a CONNECT tunnel",
    "malformed-request": "mitmproxy could not parse the request (request line, headers or HTTP/2 frames) and refused it before any hook",
    "upgrade-denied": "a protocol upgrade (`Upgrade`, `Connection: upgrade`, `HTTP2-Settings`) was requested",
    "host-header-mismatch": "the `Host` header disagrees with the request's target host or port",
    "smuggling": "ambiguous message framing or duplicated routing headers (request smuggling)",
    "body-on-bodyless-method": "a body on a GET, HEAD, OPTIONS or DELETE request",
    "trailers-denied": "the request carries HTTP trailers",
    "scheme-not-allowed": "the scheme is not allowed here (connection traffic is https only)",
    "port-invalid": "the port is not an integer from 1 to 65535",
    # --- limits (proxy side, decided before the lease; egress_proxy/edge/limits.py) ---------------------
    "head-too-large": "the request head (request line and headers) is larger than `--max-head-bytes`",
    "too-many-headers": "the request has more header fields than `--max-headers`",
    "request-line-too-long": "the request line (HTTP/2: method and `:path`) is longer than `--max-request-line`",
    "body-too-large": "the request body is larger than its limit (`--max-body`, `--max-body-for`)",
    "header-timeout": "no complete request head within `--header-timeout` seconds of its first byte (or of the connection)",
    "too-many-connections": "the client address already holds `--max-connections-per-client` open connections",
    "proxy-at-capacity": "the proxy already holds `--max-connections` open client connections",
    "streams-at-capacity": "the process already has `--max-streams-total` requests in flight (HTTP/1 and HTTP/2 streams)",
    "held-bodies-at-capacity": "holding this request body whole (HTTP/2 without `content-length`) would take the connection past `--max-held-per-connection` or the process past `--max-held`",
    "client-stalled": "the client stopped taking a response with bytes queued for it (HTTP/2: the stream's flow-control window stayed shut for `--stall-timeout` seconds; HTTP/1: its socket stayed full until `--idle-timeout`); the stream or connection was cut and the upstream closed",
    "rapid-reset": "the client reset more than 100 HTTP/2 streams, and more than it let finish (the rapid-reset attack): connection closed, after a GOAWAY `ENHANCE_YOUR_CALM` when it can still be written",
    "fd-exhausted": "the process is out of file descriptors: new connections wait in the listen backlog",
    # --- name resolution and upstream (proxy side) ------------------------------------------------
    "resolve-failed": "the host name did not resolve to any address",
    "self-connection": "the destination is one of the proxy's own addresses",
    "upstream-error": "the upstream connection or TLS handshake failed, or its answer broke HTTP (cut off, malformed status line, header, chunk or HTTP/2 frame)",
    "response-head-too-large": "the upstream's response head (status line and headers) or its trailers are larger than `--max-response-head` or hold more fields than `--max-response-headers` (counted as the bytes arrive)",
    "response-line-too-long": "a line of the upstream's response head (status line, header line) or a chunk-size line with its extensions is longer than `--max-response-line`",
    # --- the response (proxy side, egress_proxy/edge/scanner.py) ---------------------------------------
    "response-coding-unsupported": "the response uses a content or transfer coding the proxy cannot decode, so it cannot be scanned",
    "response-decode-failed": "a coded response body does not decode (corrupt, or cut short)",
    "response-too-large": "the response body from the upstream exceeds the rule's response-size cap",
    "response-event-too-large": "an SSE event of an MCP answer the edge filters (`tools/list`) is longer than 1 MiB: the stream is cut",
    "decoded-too-large": "the decoded response exceeds the decoded-size cap, or one received chunk expands past 16 MiB (decompression bomb)",
    "internal-error": "an unexpected error inside the proxy (fail closed)",
    "custody-unavailable": "the custody store (its database) cannot be reached, so no credential can be attached (fail closed)",
    "credential-unavailable": "the connection's credential cannot be read from custody: nothing is sealed at its address (a handle or connection typo, never sealed) or its record does not open with the proxy's custody keys; the log names the address (fail closed)",
    "credential-mint-failed": "the edge could not mint the connection's credential: its token endpoint refused (the denial names the provider's status, never its body), failed, redirected, or resolved to an address the connection's worker refuses (nothing is forwarded)",
    "credential-sign-unsupported": "the request cannot be re-signed as sent (SigV4 with chunk-by-chunk signed payloads, `STREAMING-AWS4-HMAC-SHA256-PAYLOAD`), so nothing is forwarded",
    "credential-record-invalid": "the custody record does not fit the connection's credential kind (another kind, a missing field, or a value that does not parse), so nothing can be attached",
    "client-disconnected": "the client left before its request was decided (nothing is kept for it), or, as an outcome's `failure`, before its answer was complete",
    # --- the exfiltration budget (egress_proxy/front/budget.py; docs/budget.md) -----------------------
    "budget-exceeded": "the subject's declared budget has no room in its current window for this request (its requests or its bytes cap): 429 with `Retry-After`, the denial names the cap, the window and when it resets",
    "budget-length-required": "the subject declares a bytes cap and the request's body has no declared length (`Content-Length`), so its cost cannot be charged before it is forwarded: 411",
    "budget-unavailable": "the budget ledger (its database) cannot be read or written, so a request of a subject with a budget cannot be charged (fail closed)",
    # --- the proxy's own state (503: the proxy, not the policy, refuses) ---------------------------
    "audit-unavailable": "the audit log cannot be written (disk full, I/O error), so nothing allowed is forwarded",
    "draining": "the proxy is shutting down and takes no new request",
    # --- the Envoy lane (egress_proxy/lane; docs/lane.md) ----------------------------------------
    "authorizer-unavailable": "the Envoy lane's authorizer did not answer in time (or answered without a decision), so Envoy refused the request itself (fail closed)",
    "lane-not-served": "the lease's subject is not served by the Envoy lane (a connection, a brokering or observed profile, or one naming an IP literal): use the mitmproxy edge, as `sandbox-env` says",
    "lane-no-route": "the authorizer admitted the request but Envoy's compiled routes hold none for it (the configuration Envoy runs is older than the artifact): nothing is forwarded",
    # --- destination (decision function) ----------------------------------------------------------
    "no-matching-rule": "no rule of the connection names this exact host and port",
    "profile-host-not-allowed": "the exact host:port is not in the sandbox profile's allowlist",
    "ip-literal-refused": "the request names an IP literal and the worker has `ip_literals = false`",
    "method-not-allowed": "a rule matches host, port and path but not the method",
    "path-not-allowed": "no rule's path prefix (segment-bounded) admits the path",
    "worker-unknown": "the connection names a worker the artifact does not contain",
    # --- request shapes (egress_proxy/decision/shapes.py; docs/shapes.md) ---------------------------
    "path-template-mismatch": "the rule's path template does not admit the path (a segment outside its constraint, or another number of segments)",
    "query-parameter-not-allowed": "the rule lists its query parameters and the query carries another (or no query is admitted)",
    "query-parameter-repeated": "a query parameter the rule lists is given more than once (parameter pollution)",
    "query-value-refused": "a query parameter's value is outside the rule's constraint for it (or does not decode to UTF-8)",
    "header-value-refused": "a header's value is outside the rule's `header_values` constraint, or the header is given twice",
    "body-too-large-to-judge": "the body a request shape must judge is longer than the rule's `max_body` (never forwarded unjudged)",
    "body-malformed": "the body a request shape must judge does not read one way: invalid UTF-8 or JSON, a duplicate key, nesting deeper than 64, or not the protocol's message form",
    "content-type-mismatch": "the request's content type is not the one the rule's protocol (MCP, GraphQL, git) uses",
    "mcp-method-not-allowed": "an MCP (JSON-RPC) message names a method the rule does not list (or is a response the rule does not admit)",
    "mcp-tool-not-allowed": "a `tools/call` names a tool the rule does not list",
    "mcp-argument-refused": "a `tools/call` argument is outside the tool's constraint: a value, a missing required key, a forbidden or unlisted key",
    "graphql-operation-not-allowed": "the GraphQL operation's type (query, mutation, subscription) has no allowed root fields in the rule",
    "graphql-field-not-allowed": "a GraphQL operation selects a root field the rule does not list for its type (aliases and fragments resolved)",
    "graphql-introspection-refused": "a GraphQL operation selects `__schema` or `__type` and the rule does not admit introspection",
    "graphql-multiple-operations": "a GraphQL document holds more than one operation, or `operationName` does not name its one operation",
    "graphql-persisted-query-not-allowed": "a persisted-query hash the rule does not list, or a document that does not hash to the hash sent with it",
    "git-service-not-allowed": "a git request other than the smart-HTTP service the rule admits (fetch or push) below its path prefix",
    "git-ref-not-allowed": "a git push updates a ref no pattern of the rule matches",
    "git-delete-refused": "a git push deletes a ref and the rule does not admit deletes",
    "git-create-refused": "a git push creates a ref and the rule does not admit creation",
    # --- addresses (decision function, public-only predicate) -------------------------------------
    "address-not-public": "an answer (or the IPv4 address embedded in it) is in the special-purpose table",
    "address-denied": "an answer (or the IPv4 address embedded in it) is in the worker's `deny_cidrs`",
    "ipv6-disabled": "an IPv6 answer (IPv4-mapped included) and the worker has `ipv6 = false`",
    "address-invalid": "an answer is not a plain IPv4 or IPv6 address (e.g. it carries a zone id)",
    # --- host normalization (compiler/normalize.py, HostError.reason) -----------------------------
    "host-empty": "the host is empty",
    "host-wildcard": "the host contains `*`",
    "host-scheme": "the host contains a scheme (`://`)",
    "host-userinfo": "the host contains userinfo (`user@`)",
    "host-path": "the host contains a path, query, fragment or backslash",
    "host-invalid-character": "the host contains whitespace or a control character",
    "host-port": "the host contains `:` and is not an IPv6 literal",
    "host-idna": "the host is not a valid internationalized name (UTS-46)",
    "host-empty-label": "the host has an empty label",
    "host-too-long": "the host is longer than 253 characters",
    "host-label-length": "a label of the host is longer than 63 characters",
    "host-label-syntax": "a label of the host is not letters, digits and inner hyphens",
    "host-bracket": "a bracketed IPv6 literal is malformed",
    "host-zone-id": "an IPv6 literal carries a zone id",
    "host-noncanonical-ip": "a non-canonical numeric IP form (`127.1`, `2130706433`, `0x7f.0.0.1`, `0177.0.0.1`)",
    # --- path normalization (compiler/normalize.py, PathError.reason) -----------------------------
    "path-fragment": "the request target carries a fragment",
    "path-not-absolute": "the path does not start with `/`",
    "path-bad-escape": "the path has a malformed percent-escape",
    "path-encoded-slash": "the path contains an encoded slash or backslash (`%2f`, `%5c`)",
    "path-encoded-dot": "the path contains an encoded dot (`%2e`)",
    "path-nul": "the path contains NUL",
    "path-parameter": "the path contains `;` parameters (or an encoded `;`)",
    "path-noncanonical-escape": "the path percent-encodes an unreserved character",
    "path-invalid-character": "the path contains a character that must be percent-encoded",
    "path-empty-segment": "the path contains `//`",
    "path-dot-segment": "the path contains a `.` or `..` segment",
    "path-query": "a path prefix contains a query",
    "path-not-canonical": "a path prefix is not in canonical form",
}


# The reasons of request shapes (docs/shapes.md): a denial for one of them names the rule and the place (`detail`).
SHAPE_REASONS = frozenset(code for code in REASONS if code.startswith(("path-template-", "query-", "header-value-", "body-too-large-to",
                                                                       "body-malformed", "content-type-", "mcp-", "graphql-", "git-")))


def describe(code: str) -> str:
    """The one-line description of a reason code (`allowed` included); unknown codes say so."""
    if code == ALLOWED:
        return "a rule (or the profile's allowlist) admits the request and every address is public"
    return REASONS.get(code, "unknown reason code")
