"""One HTTP/1.1 POST to a token endpoint, over TLS verified for the endpoint's name, to an address the caller vetted.

The edge resolves the endpoint, judges every answer with the connection's worker and passes the address to dial
(`dial`); this module never resolves a name, never follows a redirect (a 3xx is returned like any status, and the
kind refuses it), reads at most `max_bytes` of the answer and gives up after `timeout` seconds. The reply stays in
the broker: nothing here logs it. h11 (a mitmproxy dependency) frames the exchange.
"""

from __future__ import annotations

import asyncio
import ssl

import h11

from egress_proxy.credentials.base import MintFailed, Reply, TokenRequest

MAX_REPLY = 64 * 1024
TIMEOUT = 10.0


def verified_context(cafile: str | None) -> ssl.SSLContext:
    """The token endpoints' TLS: certificates verified for the endpoint's name against `cafile` (the bundle the edge
    verifies upstreams with), else certifi's roots as mitmproxy uses; TLS 1.2 at least."""
    import certifi

    context = ssl.create_default_context(cafile=cafile or certifi.where())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    return context


async def exchange(*, dial: tuple[str, int], host: str, port: int, path: str, request: TokenRequest,
                   context: ssl.SSLContext, timeout: float = TIMEOUT, max_bytes: int = MAX_REPLY) -> Reply:
    """POST `request` to https://host:port/path at address `dial`; MintFailed (no status) when no answer came."""
    try:
        return await asyncio.wait_for(_exchange(dial, host, port, path, request, context, max_bytes), timeout)
    except MintFailed:
        raise
    except TimeoutError:
        raise MintFailed(f"the token endpoint did not answer within {timeout:g}s") from None
    except ssl.SSLCertVerificationError:
        raise MintFailed("the token endpoint's certificate does not verify for its name") from None
    except (OSError, ssl.SSLError, h11.ProtocolError, EOFError) as exc:
        raise MintFailed(f"the token endpoint could not be reached ({exc.__class__.__name__})") from None


async def _exchange(dial: tuple[str, int], host: str, port: int, path: str, request: TokenRequest,
                    context: ssl.SSLContext, max_bytes: int) -> Reply:
    reader, writer = await asyncio.open_connection(dial[0], dial[1], ssl=context, server_hostname=host)
    try:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=16 * 1024)
        authority = host if port == 443 else f"{host}:{port}"
        headers = [("Host", authority), *request.headers, ("Content-Length", str(len(request.body))), ("Connection", "close")]
        writer.write(conn.send(h11.Request(method="POST", target=path, headers=headers)))
        writer.write(conn.send(h11.Data(data=request.body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        status, body = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(16 * 1024))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > max_bytes:
                    raise MintFailed(f"the token endpoint's answer is larger than {max_bytes} bytes", provider_status=status)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if not status:
            raise MintFailed("the token endpoint closed the connection without an answer")
        return Reply(status, bytes(body))
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, ssl.SSLError, TimeoutError):
            pass
