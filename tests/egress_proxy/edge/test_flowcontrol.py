"""MeteredH2Connection against a real h2 peer in memory: queues measured and reported, what was framed counted,
streams settled once, the HPACK table a peer may ask for capped; Valve waits while any stream it feeds is over."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
from mitmproxy.proxy.layers.http import _http_h2

from egress_proxy.edge.flowcontrol import (
    MAX_HPACK_TABLE,
    MeteredH2Connection,
    Valve,
    when_settled,
)
from egress_proxy.edge.limits import Limits


class Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[int, bool]] = []

    def over(self, conn, stream_id: int, over: bool) -> None:
        self.reports.append((stream_id, over))


def pair(buffer: int = 100_000):
    """A metered server side and a plain h2 client that takes only the default 65,535-byte window."""
    server = MeteredH2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    server.buffer, server.pressure = buffer, Recorder()
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    exchange(client, server)
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", "a"), (":path", "/")], end_stream=True)
    exchange(client, server)
    server.send_headers(sid, [(":status", "200")])
    return server, client, sid


def exchange(client, server) -> list:
    events = []
    for _ in range(4):
        data = client.data_to_send()
        if data:
            server.receive_data(data)
        data = server.data_to_send()
        if data:
            events += client.receive_data(data)
    return events


def test_a_queue_past_the_buffer_is_reported_once_and_released_under_half():
    server, client, sid = pair()
    meter = server.meter(sid)
    server.send_data(sid, b"x" * 200_000)
    assert meter.sent == 65535 and server.queued(sid) == 200_000 - 65535
    assert server.pressure.reports == [(sid, True)]
    server.send_data(sid, b"x" * 1000)
    assert server.pressure.reports == [(sid, True)]  # one report per crossing
    got = sum(len(e.data) for e in exchange(client, server) if isinstance(e, h2.events.DataReceived))
    assert got == 65535
    client.increment_flow_control_window(100_000, stream_id=sid)
    client.increment_flow_control_window(100_000)
    exchange(client, server)
    assert meter.sent == 165535 and server.queued(sid) == 201_000 - 165535
    assert server.pressure.reports == [(sid, True), (sid, False)]


def test_a_stream_settles_once_when_its_end_goes_out():
    server, client, sid = pair()
    meter = server.meter(sid)
    seen = []
    server.send_data(sid, b"y" * 70_000)
    server.end_stream(sid)
    assert when_settled(meter, seen.append)
    assert seen == [] and not meter.settled  # the end waits behind 4,465 queued bytes
    client.increment_flow_control_window(10_000, stream_id=sid)
    client.increment_flow_control_window(10_000)
    exchange(client, server)
    assert seen == [True] and meter.ended and meter.sent == 70_000
    assert not when_settled(meter, seen.append) and seen == [True]


def test_a_reset_stream_settles_incomplete_with_what_was_framed():
    server, client, sid = pair()
    meter = server.meter(sid)
    seen = []
    server.send_data(sid, b"z" * 100_000)
    when_settled(meter, seen.append)
    client.reset_stream(sid)
    exchange(client, server)
    assert seen == [False] and meter.reset and meter.sent == 65535
    assert server.queued(sid) == 0


def test_a_lost_connection_settles_every_stream_and_releases_its_reports():
    server, client, sid = pair(buffer=1000)
    meter = server.meter(sid)
    seen = []
    server.send_data(sid, b"z" * 100_000)
    when_settled(meter, seen.append)
    server.lost()
    assert seen == [False] and server.pressure.reports == [(sid, True), (sid, False)]
    assert server.meter(sid + 2).reset  # a stream met after the loss is settled from the start


def test_the_hpack_table_a_peer_asks_for_is_capped():
    server, client, _ = pair()
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 1 << 30})
    exchange(client, server)
    assert server.encoder.header_table_size == MAX_HPACK_TABLE


def test_a_valve_waits_while_any_key_is_paused():
    class Reader:
        async def read(self, n: int = -1) -> bytes:
            return b"data"

    async def run() -> list[str]:
        valve = Valve(Reader())
        out = []
        valve.pause("a", True)
        valve.pause("b", True)
        task = asyncio.ensure_future(valve.read(10))
        await asyncio.sleep(0.01)
        out.append("waiting" if not task.done() else "read")
        valve.pause("a", False)
        await asyncio.sleep(0.01)
        out.append("waiting" if not task.done() else "read")
        valve.pause("b", False)
        out.append((await task).decode())
        return out

    assert asyncio.run(run()) == ["waiting", "waiting", "data"]


def test_rapid_resets_get_a_goaway_and_are_reported():
    class Calm(Recorder):
        calmed = 0

        def rapid_reset(self, conn) -> None:
            self.calmed += 1

    server, client, first = pair()
    server.pressure = Calm()
    server.meter(first)
    server.end_stream(first)  # one stream finished
    events = []
    for _ in range(100):  # HEADERS and RST_STREAM at once, as the attack sends them
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", "a"), (":path", "/")], end_stream=True)
        client.reset_stream(sid)
        events += exchange(client, server)
    assert server.pressure.calmed == 0 and not server.calmed  # 100 resets are within the budget
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "GET"), (":scheme", "https"), (":authority", "a"), (":path", "/")], end_stream=True)
    client.reset_stream(sid)
    events += exchange(client, server)
    assert server.pressure.calmed == 1 and server.calmed
    goaway = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
    assert goaway and goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def test_the_advertised_receive_window_is_what_may_be_in_flight():
    server = MeteredH2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
    server.advertise(1 << 20)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    server.initiate_connection()
    exchange(client, server)
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", "a"), (":path", "/")])
    assert client.local_flow_control_window(sid) == 1 << 20  # mitmproxy's own: 2^31-1
    unmetered = _http_h2.BufferedH2Connection(h2.config.H2Configuration(client_side=False))
    assert unmetered.local_settings.initial_window_size == 2**31 - 1


def test_an_upstream_connection_closed_without_goaway_releases_its_pauses():
    """An upstream HTTP/2 connection whose socket just closes: the client's reader is not left paused for it, and
    the proxy keeps nothing of it."""
    server, client, sid = pair(buffer=1000)
    server.send_data(sid, b"u" * 100_000)  # a request body the upstream does not take
    assert server.pressure.reports == [(sid, True)]
    limits = Limits()
    limits.metered_upstream("up-1", server)
    limits.server_disconnected(SimpleNamespace(id="client-1"), SimpleNamespace(id="up-1"))
    assert server.pressure.reports == [(sid, True), (sid, False)]
    limits.server_disconnected(SimpleNamespace(id="client-1"), SimpleNamespace(id="up-1"))  # once only
    assert server.pressure.reports == [(sid, True), (sid, False)]
