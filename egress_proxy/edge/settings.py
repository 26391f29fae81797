"""Every setting of the proxy that has a default, declared once: the CLI's flags, `EdgeConfig` and the addon's
mitmproxy options all read their defaults from `DEFAULTS`. Imports nothing (the CLI loads it for `--help`).

Sizes are bytes, times seconds. docs/proxy.md ("Limits", "Options") says what each one does.
"""

from __future__ import annotations

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
