"""Backpressure end to end, and what a peer actually took: the bounds mitmproxy's HTTP/2 connection does not keep.

mitmproxy reads every connection as fast as it can and relies on its writers draining (`drain_writers`): that
bounds HTTP/1, where a full socket stops all reading. HTTP/2 has a second buffer the sockets never see:
`BufferedH2Connection.send_data` queues, without limit, what a peer's shut flow-control window will not take. A
client that never sends `WINDOW_UPDATE` made the proxy hold a whole 96 MiB download. Here:

- `MeteredH2Connection` stands in for mitmproxy's class (installed by `install()`, from `layers.install`). It
  counts the DATA bytes each stream actually framed (`sent`: what the peer was given, the audit's `bytes_down`),
  reports a stream whose queue passes `--stream-buffer` (and again once it is back under half of it) to its
  `Pressure`, tells waiters when a stream's end went out or it was reset, lowers the HPACK table a peer may make
  us keep, and advertises the receive window the layer gives it (`advertise`).
- A queue over the buffer on the client's side stops the proxy reading that stream's upstream connection
  (`Limits.pause_server`: its reader, a `Valve`, waits), so the upstream's own TCP window is what fills; on an
  upstream HTTP/2 connection (a request body it will not take) it stops the proxy reading the client
  (`Limits.pause_client`).
- A peer that resets more than 100 streams, and more than it let finish (the rapid-reset attack), gets a GOAWAY
  (`ENHANCE_YOUR_CALM`) queued and its connection closed (`rapid-reset`, audited).
- `egress_proxy.edge.limits._Stream` arms a `--stall-timeout` wakeup while its stream has bytes queued and resets
  the stream when none were taken in that time (`client-stalled`, audited), and the addon writes a response's
  outcome event only once its last byte was framed or the stream was reset (`when_settled`).

Per stream, the proxy then queues at most `--stream-buffer` plus one read (64 KiB); docs/proxy.md ("Bounds") has
the whole formula and what was measured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
from mitmproxy.proxy.layers.http import _http2, _http_h2

log = logging.getLogger("egresslaw.proxy")

MAX_HPACK_TABLE = 64 * 1024  # the most dynamic HPACK table a peer's SETTINGS_HEADER_TABLE_SIZE makes us keep for it
RESET_BUDGET = 100  # streams a peer may reset before their count is held against the streams it let finish

Settled = Callable[[bool], None]  # called once: True when the stream's end went out, False when it was reset or lost


class Pressure(Protocol):
    """What a metered connection tells about its queues; `EgressHttpLayer` (limits.py) is one."""

    def over(self, conn: MeteredH2Connection, stream_id: int, over: bool) -> None:
        """Stream `stream_id`'s queue went over the buffer (`over`) or back under half of it."""

    def rapid_reset(self, conn: MeteredH2Connection) -> None:
        """The peer resets streams faster than it lets them finish (CVE-2023-44487): the connection must go."""


class StreamMeter:
    """One stream's account, kept by whoever handles the stream (the metered connection lets go of it at its end)."""

    __slots__ = ("sent", "ended", "reset", "waiter")

    def __init__(self) -> None:
        self.sent = 0  # DATA bytes framed for the peer: what it was given
        self.ended = False  # the stream's END_STREAM went out
        self.reset = False  # reset (either side) or the connection was lost before its end went out
        self.waiter: Settled | None = None

    @property
    def settled(self) -> bool:
        return self.ended or self.reset


class _Framed(h2.connection.H2Connection):
    """Counts what h2 frames per stream: below mitmproxy's buffering (see MeteredH2Connection's bases)."""

    meters: dict[int, StreamMeter]

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False, pad_length: Any = None) -> None:
        super().send_data(stream_id, data, end_stream, pad_length)
        meter = self.meters.get(stream_id)
        if meter is not None:
            meter.sent += len(data)
        if end_stream:
            self._settle(stream_id, True)

    def send_headers(self, stream_id: int, headers: Any, end_stream: bool = False, *args: Any, **kwargs: Any) -> None:
        super().send_headers(stream_id, headers, end_stream, *args, **kwargs)
        if end_stream:
            self._settle(stream_id, True)

    def _settle(self, stream_id: int, complete: bool) -> None:  # pragma: no cover - MeteredH2Connection's
        pass


class MeteredH2Connection(_http_h2.BufferedH2Connection, _Framed):
    """mitmproxy's buffered HTTP/2 connection with its queues measured and reported.

    The method order is MeteredH2Connection, BufferedH2Connection, _Framed, H2Connection: mitmproxy's
    `super().send_data(...)` (the bytes a window lets out now) reaches `_Framed`, which counts them."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.meters = {}
        self.buffer = 1 << 62  # set by the layer that owns the connection; until then nothing is reported
        self.receive_window: int | None = None  # the connection window we advertise (None: mitmproxy's 2^31-1)
        self.pressure: Pressure | None = None
        self._over: set[int] = set()
        self._lost = False
        self.resets = 0  # streams the peer reset
        self.finished = 0  # streams whose end went out
        self.calmed = False  # a GOAWAY (ENHANCE_YOUR_CALM) was queued for rapid resets

    def advertise(self, window: int) -> None:
        """Advertise `window` bytes (not mitmproxy's 2^31-1) as the receive window of the connection and of each
        stream: what a peer may have in flight to us (called before the connection preface goes out)."""
        self.receive_window = window
        self.local_settings.initial_window_size = window
        self.local_settings.acknowledge()  # (as mitmproxy does for its own value: sent in the preface)

    def initiate_connection(self) -> None:
        if self.receive_window is None:
            return super().initiate_connection()
        # h2's preface with our settings, then the connection window raised to ours (BufferedH2Connection's own
        # override would raise it to 2^31-1).
        h2.connection.H2Connection.initiate_connection(self)
        if self.receive_window > self.inbound_flow_control_window:
            self.increment_flow_control_window(self.receive_window - self.inbound_flow_control_window)

    def meter(self, stream_id: int) -> StreamMeter:
        """The account of a stream (made at its start by its handler, which keeps it; dropped here at its end)."""
        meter = self.meters.get(stream_id)
        if meter is None:
            meter = self.meters[stream_id] = StreamMeter()
            meter.reset = self._lost
        return meter

    def queued(self, stream_id: int) -> int:
        """Bytes waiting for this stream's window."""
        chunks = self.stream_buffers.get(stream_id)
        return sum(len(chunk.data) for chunk in chunks) if chunks else 0

    # -- what changes the queues ------------------------------------------------------------------------------------

    def send_data(self, stream_id: int, data: bytes, end_stream: bool = False, pad_length: None = None) -> None:
        super().send_data(stream_id, data, end_stream, pad_length)
        self._check(stream_id)

    def stream_window_updated(self, stream_id: int) -> bool:
        sent_any = super().stream_window_updated(stream_id)
        self._check(stream_id)
        return sent_any

    def reset_stream(self, stream_id: int, error_code: int = 0) -> None:
        try:
            super().reset_stream(stream_id, error_code)
        finally:
            self._check(stream_id)
            self._settle(stream_id, False)

    def receive_data(self, data: Any) -> list:
        events = super().receive_data(data)
        for stream_id in list(self._over):
            self._check(stream_id)
        for event in events:
            if isinstance(event, h2.events.StreamReset):
                self._settle(event.stream_id, False)
                if event.remote_reset:  # (counted whether or not the stream got as far as a meter: HEADERS and
                    self.resets += 1  # RST_STREAM in one read reach us before mitmproxy made the stream)
                    if self.resets > RESET_BUDGET and self.resets > self.finished and not self.calmed:
                        self._calm()
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.lost()
            elif isinstance(event, h2.events.RemoteSettingsChanged) and self.encoder.header_table_size > MAX_HPACK_TABLE:
                self.encoder.header_table_size = MAX_HPACK_TABLE  # the peer allows more; we keep no more for it
        return events

    # -- reports -----------------------------------------------------------------------------------------------------

    def _check(self, stream_id: int) -> None:
        if self.pressure is None:
            return
        queued = self.queued(stream_id)
        if stream_id in self._over:
            if queued <= self.buffer // 2:
                self._over.discard(stream_id)
                self._report(stream_id, False)
        elif queued > self.buffer:
            self._over.add(stream_id)
            self._report(stream_id, True)

    def _report(self, stream_id: int, over: bool) -> None:
        try:
            assert self.pressure is not None
            self.pressure.over(self, stream_id, over)
        except Exception:
            log.error("internal error while reporting an HTTP/2 queue (%s)", "pressure")

    def _calm(self) -> None:
        self.calmed = True
        try:
            self.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        except h2.exceptions.ProtocolError:
            pass
        if self.pressure is not None:
            try:
                self.pressure.rapid_reset(self)
            except Exception:
                log.error("internal error while reporting rapid resets (%s)", "pressure")

    def _settle(self, stream_id: int, complete: bool) -> bool:
        """Settle a metered stream (True if it was not settled yet)."""
        meter = self.meters.pop(stream_id, None)
        if meter is None or meter.settled:
            return False
        if complete:
            self.finished += 1
        meter.ended, meter.reset = complete, not complete
        waiter, meter.waiter = meter.waiter, None
        if waiter is not None:
            _call(waiter, complete)
        return True

    def lost(self) -> None:
        """The connection is gone (GOAWAY, or its socket closed): nothing queued will be taken."""
        self._lost = True
        self.stream_buffers.clear()
        for stream_id in list(self._over):
            self._over.discard(stream_id)
            self._report(stream_id, False)
        for stream_id in list(self.meters):
            self._settle(stream_id, False)


def when_settled(meter: StreamMeter, waiter: Settled) -> bool:
    """Call `waiter` once the metered stream's end went out (True) or it was reset or lost (False); False (and no
    call) when that already happened, so the caller goes on at once."""
    if meter.settled:
        return False
    meter.waiter = waiter
    return True


def _call(waiter: Settled, complete: bool) -> None:
    try:
        waiter(complete)
    except Exception:
        log.error("internal error while settling an HTTP/2 stream (%s)", "waiter")


class Valve:
    """A connection's reader that waits while any stream it feeds has too much queued on the other side (an upstream
    connection's, for a client that does not read; limits._Gate, the client's, adds its own reasons to wait)."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader
        self._keys: set[Any] = set()  # the (connection, stream) pairs over their buffer
        self._open = asyncio.Event()
        self._open.set()

    def pause(self, key: Any, on: bool) -> None:
        if on:
            self._keys.add(key)
        else:
            self._keys.discard(key)
        self._update()

    def _closed(self) -> bool:
        return bool(self._keys)

    def _update(self) -> None:
        if self._closed():
            self._open.clear()
        else:
            self._open.set()

    async def read(self, n: int = -1) -> bytes:
        await self._open.wait()
        return await self._reader.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def owner_of(context: Any) -> Any:
    """The nearest HTTP layer above a connection layer that bounds its connections (limits.EgressHttpLayer), or None."""
    for layer in reversed(context.layers):
        if hasattr(layer, "adopt_h2"):
            return layer
    return None


def _wrap_init(original):
    def __init__(self, context: Any, conn: Any) -> None:
        original(self, context, conn)
        owner = owner_of(context)
        if owner is not None:
            owner.adopt_h2(self)

    __init__.__wrapped__ = original
    return __init__


def install() -> None:
    """mitmproxy's HTTP/2 layers build a MeteredH2Connection, adopted by the HTTP layer above them (once per process;
    `layers.install` checked the names first)."""
    if _http2.BufferedH2Connection is MeteredH2Connection:
        return
    _http2.BufferedH2Connection = MeteredH2Connection
    _http2.Http2Connection.__init__ = _wrap_init(_http2.Http2Connection.__init__)
