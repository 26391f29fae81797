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


class _UdpServer:
    """A UDP server on 127.0.0.1 with its own asyncio loop in a daemon thread; subclasses answer `_received`."""

    def _start(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._transport: asyncio.DatagramTransport | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name=name)
        self.thread.start()
        ready.wait(10)
        assert self._transport is not None, f"{name} did not start"
        self.address: tuple[str, int] = self._transport.get_extra_info("sockname")[:2]

    @property
    def nameserver(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self

        class Protocol(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr) -> None:
                server._received(data, addr)

        async def start() -> None:
            self._transport, _ = await self.loop.create_datagram_endpoint(Protocol, local_addr=("127.0.0.1", 0))
            self._listening()

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def _listening(self) -> None:
        """Called on the server's loop once it listens."""

    def _received(self, data: bytes, addr) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        def close() -> None:
            if self._transport is not None:
                self._transport.close()
            self.loop.stop()

        self.loop.call_soon_threadsafe(close)
        self.thread.join(10)


class DnsStandin(_UdpServer):
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
        self._held: list[tuple[bytes, tuple]] = []
        self._start("the DNS stand-in")

    def total(self) -> int:
        with self.lock:
            return sum(self.queries.values())

    def _listening(self) -> None:
        if self.hold:
            self.loop.call_later(self.hold_max, self._release)

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
        super().stop()
        self.loop.close()


class ScriptedDns(_UdpServer):
    """A real DNS server on 127.0.0.1 that answers from a `ScriptedResolver` (tests/proxy_harness.py), so a proxy in
    another process (`egresslaw proxy --workers N`, `--nameserver`) sees the very answers, sequences, delays and
    failures the in-process tests script, and the resolver's `calls` count its lookups.

    The proxy's resolver asks A and AAAA together for one lookup: the two queries are paired and answered from one
    call of the scripted resolver (a retransmission, same id, shares it too). Answers carry TTL 0 (never cached, as
    the injected resolver is never cached). A scripted failure is SERVFAIL, an unknown name NXDOMAIN."""

    def __init__(self, resolver) -> None:
        self.resolver = resolver
        self._open: dict[str, list[dict]] = {}  # name -> lookups still owed one of their two queries
        self._seen: collections.OrderedDict[tuple, dict] = collections.OrderedDict()  # (name, type, id) -> lookup
        self._start("the scripted DNS server")

    def _lookup(self, name: str, rdtype: int, qid: int) -> dict:
        key = (name, rdtype, qid)
        if key in self._seen:  # a retransmission of a query already paired
            return self._seen[key]
        owed = self._open.setdefault(name, [])
        lookup = next((entry for entry in owed if rdtype in entry["left"]), None)
        if lookup is None:
            lookup = {"left": {dns.rdatatype.A, dns.rdatatype.AAAA}, "task": self.loop.create_task(self._call(name))}
            owed.append(lookup)
        lookup["left"].discard(rdtype)
        if not lookup["left"]:
            owed.remove(lookup)
        self._seen[key] = lookup
        while len(self._seen) > 10_000:
            self._seen.popitem(last=False)
        return lookup

    async def _call(self, name: str):
        try:
            return list(await self.resolver(name, 0))
        except OSError as exc:
            return exc
        except Exception as exc:  # a scripted failure of any other kind
            return exc

    def _received(self, data: bytes, addr) -> None:
        try:
            query = dns.message.from_wire(data)
            question = query.question[0]
        except Exception:
            return
        name = question.name.to_text().rstrip(".").lower()
        if question.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
            self._send(dns.message.make_response(query), addr)
            return
        lookup = self._lookup(name, question.rdtype, query.id)
        lookup["task"].add_done_callback(lambda task: self._answer(query, question, task.result(), addr))

    def _answer(self, query, question, result, addr) -> None:
        response = dns.message.make_response(query)
        if isinstance(result, OSError) and str(result) == "no such name":
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif isinstance(result, BaseException):
            response.set_rcode(dns.rcode.SERVFAIL)
        else:
            want = 4 if question.rdtype == dns.rdatatype.A else 6
            ips = [ip for ip in result if ipaddress.ip_address(ip).version == want]
            if ips:
                response.answer.append(dns.rrset.from_text_list(question.name, 0, dns.rdataclass.IN, question.rdtype, ips))
        self._send(response, addr)

    def _send(self, response, addr) -> None:
        if self._transport is not None:
            self._transport.sendto(response.to_wire(), addr)
