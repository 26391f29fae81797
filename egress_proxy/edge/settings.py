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
    idle_timeout: int = 300  # no byte either way (mitmproxy's `tcp_timeout`; its own 600 would let an idle client sit 10 minutes)
    # response caps (credentialed traffic)
    max_response: str = "1g"  # a credentialed response body as received
    max_decoded: str = "1g"  # ... once decoded (decompression bombs)


DEFAULTS = Defaults()
