"""A real DNS server for tests, on 127.0.0.1 (UDP): answers A and AAAA queries from a table after a
delay, or never, and counts what it was asked.

Built with dnspython's message API; runs its own asyncio loop in a daemon thread. Names not in the
table get NXDOMAIN. `hold` makes it keep every answer back until that many queries are waiting at
once (a deterministic proof that the client sends them concurrently), or `hold_max` seconds pass.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import threading

import dns.message
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


class DnsStandin:
    def __init__(self, table: dict[str, list[str]] | None = None, *, delay: float = 0.0, ttl: int = 300,
                 silent: bool = False, hold: int = 0, hold_max: float = 30.0) -> None:
        self.table = {k.rstrip(".").lower(): v for k, v in (table or {}).items()}
        self.delay = delay
        self.ttl = ttl
        self.silent = silent
        self.hold = hold
        self.hold_max = hold_max
        self.queries: collections.Counter[tuple[str, str]] = collections.Counter()
        self.waiting = 0
        self.max_waiting = 0
        self.released = False
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self._held: list[tuple[bytes, tuple]] = []
        self._transport: asyncio.DatagramTransport | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="dns-standin")
        self.thread.start()
        ready.wait(10)
        assert self._transport is not None, "the DNS stand-in did not start"
        self.address: tuple[str, int] = self._transport.get_extra_info("sockname")[:2]

    @property
    def nameserver(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def total(self) -> int:
        with self.lock:
            return sum(self.queries.values())

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        standin = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr) -> None:
                standin._received(data, addr)

        async def start() -> None:
            self._transport, _ = await self.loop.create_datagram_endpoint(Protocol, local_addr=("127.0.0.1", 0))
            if self.hold:
                self.loop.call_later(self.hold_max, self._release)

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def _received(self, data: bytes, addr) -> None:
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return
        question = query.question[0] if query.question else None
        with self.lock:
            if question is not None:
                self.queries[(question.name.to_text().rstrip(".").lower(), dns.rdatatype.to_text(question.rdtype))] += 1
            if self.silent:
                return
            self.waiting += 1
            self.max_waiting = max(self.max_waiting, self.waiting)
            if self.hold and not self.released:
                self._held.append((data, addr))
                if self.waiting < self.hold:
                    return
        if self.hold and not self.released:
            self._release()
        else:
            self.loop.call_later(self.delay, self._answer, data, addr)

    def _release(self) -> None:
        with self.lock:
            self.released = True
            held, self._held = self._held, []
        for data, addr in held:
            self.loop.call_later(self.delay, self._answer, data, addr)

    def _answer(self, data: bytes, addr) -> None:
        with self.lock:
            self.waiting -= 1
        query = dns.message.from_wire(data)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        if name not in self.table:
            response.set_rcode(dns.rcode.NXDOMAIN)
        else:
            want = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 6}.get(question.rdtype)
            ips = [ip for ip in self.table[name] if ipaddress.ip_address(ip).version == want]
            if ips:
                response.answer.append(dns.rrset.from_text_list(question.name, self.ttl, dns.rdataclass.IN, question.rdtype, ips))
        if self._transport is not None:
            self._transport.sendto(response.to_wire(), addr)

    def stop(self) -> None:
        def close() -> None:
            if self._transport is not None:
                self._transport.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(close)
        self.thread.join(10)
        self.loop.close()
