"""Every setting of the proxy that has a default, declared once: the CLI's flags, `EdgeConfig` and the addon's
mitmproxy options all read their defaults from `DEFAULTS`. Imports nothing (the CLI loads it for `--help`).

Sizes are bytes, times seconds. docs/proxy.md ("Limits", "Options") says what each one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True, slots=True)
class Defaults:
    """The proxy's defaults (`egresslaw proxy --help` shows them, `EdgeConfig` and the addon start from them)."""

    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:9090"
    confdir: str = "~/.egresslaw"
    store: str = "custody.db"
    budget_store: str = "budget.db"  # the budget ledger (docs/budget.md): a SQLite file or a postgresql:// URL
    audit_log: str = "egresslaw-audit.jsonl"
    audit_max_bytes: int = 64 * MiB  # rotate the audit log's active file at this size ...
    audit_max_age: int = 86400  # ... or this age
    audit_sync: str = "1"  # `request`: fsync before forwarding; SECONDS: written before forwarding, fsync'd within SECONDS
    drain_grace: float = 10.0  # at SIGTERM, how long requests in flight get to finish
    dns_timeout: float = 5.0  # a lookup slower than this is resolve-failed (queueing included)
    dns_concurrency: int = 256  # names looked up at once
    # request-side limits
    max_head_bytes: int = 64 * KiB  # request line + headers (HTTP/1 as sent; HTTP/2 decoded)  -> 431 head-too-large
    max_headers: int = 100  # header fields  -> 431 too-many-headers
    max_request_line: int = 8 * KiB  # request line (HTTP/1) or method + :path (HTTP/2)  -> 414 request-line-too-long
    max_body: int = 64 * MiB  # request body unless --max-body-for names the connection/profile (or rule)  -> 413
    max_connections_per_client: int = 128  # open connections from one client address  -> 429 too-many-connections
    max_connections: int = 0  # open client connections in total; 0: derived from RLIMIT_NOFILE  -> 503 proxy-at-capacity
    header_timeout: float = 10.0  # first byte of a head to its end (and accept to first byte)  -> 408 header-timeout
    # what an upstream sends before a body (and trailers): counted as the bytes arrive  -> 502
    max_response_head: int = 64 * KiB  # status line + header fields (and, alone, the trailer fields)  -> response-head-too-large
    max_response_headers: int = 100  # header fields (or trailer fields)  -> response-head-too-large
    max_response_line: int = 16 * KiB  # the status line, one header line, one chunk-size line with its extensions  -> response-line-too-long
    # memory a peer can make the proxy hold (docs/proxy.md "Bounds")
    stream_buffer: int = 256 * KiB  # bytes queued for one HTTP/2 stream whose peer shut its window: then the other side is not read
    stall_timeout: float = 60.0  # a stream with bytes queued and none taken for this long is reset  -> client-stalled
    max_streams: int = 100  # HTTP/2 streams in flight on one client connection (SETTINGS_MAX_CONCURRENT_STREAMS)
    max_streams_total: int = 1024  # requests in flight in the process (HTTP/1 and HTTP/2)  -> 503 streams-at-capacity
    max_held_per_connection: int = 64 * MiB  # request bodies held whole (HTTP/2 without content-length), one connection  -> 503
    max_held: int = 256 * MiB  # ... all connections of the process  -> 503 held-bodies-at-capacity
    idle_timeout: int = 300  # no byte either way (mitmproxy's `tcp_timeout`; its own 600 would let an idle client sit 10 minutes)
    # response caps (credentialed traffic)
    max_response: str = "1g"  # a credentialed response body as received
    max_decoded: str = "1g"  # ... once decoded (decompression bombs)


DEFAULTS = Defaults()


# The bounds on memory a peer can make the proxy hold, one row each: (field, kind, what it bounds). The CLI's flags
# (`--max-response-head` ...), EdgeConfig.bounds and the addon's options (`egresslaw_max_response_head` ...) are made
# from this table; egress_proxy/edge/limits.py checks the values.
BOUNDS: tuple[tuple[str, str, str], ...] = (
    ("max_response_head", "size", "largest response head from an upstream, status line and headers; trailers alone the same (502 response-head-too-large)"),
    ("max_response_headers", "count", "most header (or trailer) fields in a response from an upstream (502 response-head-too-large)"),
    ("max_response_line", "size", "longest status line, header line or chunk-size line from an upstream (502 response-line-too-long)"),
    ("stream_buffer", "size", "bytes queued for one HTTP/2 stream whose reader shut its window, before the other side stops being read"),
    ("stall_timeout", "seconds", "seconds a stream may have bytes queued with none taken before it is reset (client-stalled)"),
    ("max_streams", "count", "HTTP/2 streams in flight on one client connection (more are refused by the protocol)"),
    ("max_streams_total", "count", "requests in flight in the process (503 streams-at-capacity)"),
    ("max_held_per_connection", "size", "request bodies held whole (HTTP/2 without content-length) by one connection (503 held-bodies-at-capacity)"),
    ("max_held", "size", "request bodies held whole by the whole process (503 held-bodies-at-capacity)"),
)


# -- the options both front ends take, declared once ---------------------------------------------------------------
# `egresslaw proxy` and `egresslaw lane` add their options from this table (`add_options`), so a shared option has one
# spelling, one type, one default (unless `per_command` says the lane's differs) and one environment variable:
# `EGRESSLAW_<DEST>` for both commands (`egresslaw.common.options_from_environment`). A flag wins over a variable.

ENV_PREFIX = "EGRESSLAW_"
LANE_LISTEN = "127.0.0.1:8081"  # beside a proxy on 8080 on the same host
LANE_ADMIN = "127.0.0.1:9091"
LANE_AUDIT_LOG = "egresslaw-lane-audit.jsonl"  # one chain per writer: the lane never appends to the proxy's


@dataclass(frozen=True, slots=True)
class Option:
    """One command-line option: `--flag` (dest from it), its value's kind, default and help; `per_command` overrides
    the default for a command; `group` is the help section (None: the command's own list)."""

    flag: str
    kind: str  # text | flag | list | positive | seconds | grace | sync | float | int
    help: str
    default: object = None
    metavar: str | None = None
    required: bool = False
    group: str | None = None
    per_command: tuple[tuple[str, object], ...] = ()

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def default_for(self, command: str) -> object:
        return dict(self.per_command).get(command, self.default)


D = DEFAULTS
ROUTING = "test routing (tests and staging only; warned at start-up and recorded in every audit event)"
DNS = "name resolution (asynchronous; every answer still judged)"
LOGGING = "logging"
EXPORT = "audit export (OCSF over OTLP to a collector; docs/audit-export.md)"
SHARED: tuple[Option, ...] = (
    Option("--artifact", "text", "the compiled artifact (build/egresslaw.json)", metavar="A", required=True),
    Option("--proof", "text", "the proof report for that artifact (build/proof.json)", metavar="P", required=True),
    Option("--keys", "text", "the keys directory (lease.key, the audit key; custody.key for the proxy)", metavar="KEYS", required=True),
    Option("--listen", "text", "the proxy address clients are given", D.listen, "HOST:PORT", per_command=(("lane", LANE_LISTEN),)),
    Option("--admin", "text", "admin (/metrics, /healthz, /readyz) listen address", D.admin, "HOST:PORT", per_command=(("lane", LANE_ADMIN),)),
    Option("--confdir", "text", "CA and admin token directory, shared by the proxy and the lane", D.confdir, "DIR"),
    Option("--audit-log", "text", "the chained JSONL audit log (one per process)", D.audit_log, "F", per_command=(("lane", LANE_AUDIT_LOG),)),
    Option("--audit-max-bytes", "positive", "rotate the audit log when its active file reaches N bytes", D.audit_max_bytes, "N"),
    Option("--audit-max-age", "positive", "rotate the audit log when its active file is this old", D.audit_max_age, "SECONDS"),
    Option("--audit-sync", "sync", "when an allowed request's decision event must be on disk: `request` = fsync'd before it is "
           "forwarded; SECONDS = written before, fsync'd within SECONDS (docs/proxy.md)", D.audit_sync, "request|SECONDS"),
    Option("--budget-store", "text", "the budget ledger, opened when the artifact declares a budget: a SQLite file every front end on "
           "the host shares, or a `postgresql://` URL a fleet shares (docs/budget.md)", D.budget_store, "FILE|URL"),
    Option("--drain-grace", "grace", "at SIGTERM, how long requests in flight get to finish", D.drain_grace, "SECONDS"),
    Option("--allow-unproven", "flag", "serve an artifact that is not all-proved (warned at start-up and in every event)", False),
    Option("--trust-proofs", "text", "the Ed25519 public key proof reports must be signed by (`keys init --proof-signing`); "
           "required unless --allow-unsigned-proofs", metavar="PUBKEY"),
    Option("--allow-unsigned-proofs", "flag", "development only: accept an unsigned proof report (logged at start-up)", False),
    Option("--require-within", "text", "also require the report to prove `within` for every subject against the ceiling artifact of "
           "this digest (12+ hex digits; `egresslaw show CEILING.json` prints it)", metavar="DIGEST"),
    Option("--nameserver", "list", "a DNS server to ask (repeatable; default: /etc/resolv.conf)", metavar="IP[:PORT]", group=DNS),
    Option("--dns-timeout", "float", "a lookup slower than this denies `resolve-failed`", D.dns_timeout, "SECONDS", group=DNS),
    Option("--dns-concurrency", "int", "names looked up at once; more wait for a slot", D.dns_concurrency, "N", group=DNS),
    Option("--resolve", "list", "answers for HOST (still judged); with any --resolve, a name not listed gets NXDOMAIN, never the "
           "system resolver", metavar="HOST=IP[,IP...]", group=ROUTING),
    Option("--connect-to", "list", "after every check, dial ADDR:APORT instead (TLS still verifies HOST)", metavar="HOST:PORT:ADDR:APORT",
           group=ROUTING),
    Option("--upstream-ca", "text", "also trust this CA for upstream certificates", metavar="FILE", group=ROUTING),
    Option("--export-to", "text", "ship every audit line as an OCSF record to this OTLP collector: grpc://HOST:PORT, grpcs://HOST:PORT, "
           "http(s)://HOST:PORT[/PATH] (a child process reads the chain; the front end never waits on it)", metavar="URL", group=EXPORT),
    Option("--export-headers", "text", "`Name: value` lines sent with every export (the collector's auth; never logged)", metavar="FILE", group=EXPORT),
    Option("--export-ca", "text", "trust this CA for the collector's certificate", metavar="FILE", group=EXPORT),
    Option("--export-cert", "text", "a client certificate for the collector (with --export-key)", metavar="FILE", group=EXPORT),
    Option("--export-key", "text", "the client certificate's key", metavar="FILE", group=EXPORT),
    Option("--export-state", "text", "the exporter's checkpoint directory (default: <audit log>.export beside the log)", metavar="DIR", group=EXPORT),
)


def add_options(parser, command: str, *, parsers) -> None:
    """Add every shared option to `parser` (an argparse parser of `command`: "proxy" or "lane"). `parsers` maps a
    kind to its argparse `type` (the CLI's own validators: this module imports nothing)."""
    groups: dict[str, object] = {}
    for opt in SHARED:
        where = parser if opt.group is None else groups.setdefault(opt.group, parser.add_argument_group(opt.group))
        default = opt.default_for(command)
        shown = "" if default in (None, False, ()) or opt.required else f" (default {default})"
        if opt.kind == "flag":
            where.add_argument(opt.flag, action="store_true", help=opt.help)  # type: ignore[attr-defined]
        elif opt.kind == "list":
            where.add_argument(opt.flag, action="append", default=[], metavar=opt.metavar, help=opt.help)  # type: ignore[attr-defined]
        else:
            kwargs = {"type": parsers[opt.kind]} if opt.kind in parsers else {}
            where.add_argument(opt.flag, default=default, metavar=opt.metavar, required=opt.required,  # type: ignore[attr-defined]
                               help=opt.help + shown, **kwargs)


@dataclass(frozen=True, kw_only=True)
class FrontConfig:
    """What both front ends take, once (`EdgeConfig` and `LaneConfig` add their own): the policy and its gate, the
    keys, the audit log, the addresses, name resolution, test routing, the head limits and the drain. Addresses as
    (host, port); `admin=None` disables the admin port."""

    artifact: str
    proof: str
    keys: str
    audit_log: str
    budget_store: str = DEFAULTS.budget_store  # the budget ledger (opened only when the artifact declares a budget)
    listen: tuple[str, int] = ("127.0.0.1", 8080)
    admin: tuple[str, int] | None = ("127.0.0.1", 9090)
    confdir: str = DEFAULTS.confdir
    allow_unproven: bool = False
    trust_proofs: str | None = None  # accept only proof reports signed by this Ed25519 public key
    allow_unsigned_proofs: bool = False  # accept an unsigned report (development only; logged)
    require_within: str | None = None  # the ceiling digest a report must prove `within` against (prove --within)
    resolve: Sequence[str] = ()
    connect_to: Sequence[str] = ()
    upstream_ca: str | None = None
    nameservers: Sequence[str] = ()  # IP[:PORT] the resolver asks; () = /etc/resolv.conf
    dns_timeout: float = DEFAULTS.dns_timeout
    dns_concurrency: int = DEFAULTS.dns_concurrency
    audit_sync: str = DEFAULTS.audit_sync
    audit_max_bytes: int = DEFAULTS.audit_max_bytes
    audit_max_age: int = DEFAULTS.audit_max_age
    drain_grace: float = DEFAULTS.drain_grace  # seconds in-flight requests get to finish at shutdown
    idle_timeout: int = DEFAULTS.idle_timeout
    header_timeout: float = DEFAULTS.header_timeout
    max_head_bytes: int = DEFAULTS.max_head_bytes
    max_headers: int = DEFAULTS.max_headers
    max_connections: int = DEFAULTS.max_connections
    export_to: str | None = None  # the OTLP collector the audit exporter ships to (None: no exporter)
    export_headers: str | None = None
    export_ca: str | None = None
    export_cert: str | None = None
    export_key: str | None = None
    export_state: str | None = None
    watch_interval: float = 1.0  # seconds between looks at the artifact and proof files (a change reloads)
