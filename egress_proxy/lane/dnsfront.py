"""The resolver Envoy dials through: it answers only what the worker admits.

Envoy's upstream clusters resolve their host names through this UDP server on loopback (c-ares, no fallback to the
system's resolvers). For an A or AAAA query it looks the name up with the lane's resolver (the same lookups, and
cache, the authorizer judged), judges the whole answer set with the `default` worker (`judge_ips`, the core's
`answers_verdict`: the worker every profile's request is judged by) and

- admitted: answers the records of the asked family (TTL at most `TTL` seconds, so a rebinding is judged again
  within that time);
- refused (a private, special-purpose or denied address among them, IPv6 on an IPv4-only worker, ...): answers
  NOERROR with no record, and remembers why. Envoy then has no address for the name: nothing is dialled (its
  request fails `no healthy upstream`, which the access-log reader records with the remembered reason).

Envoy can therefore never dial an address the worker refuses, DNS rebinding included: every answer it ever gets
went through `judge_ips`. Other query types get an empty answer. At most `MAX_PENDING` queries are worked on at
once; more are dropped (c-ares retries).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

from compiler.constants import DEFAULT_WORKER
from egress_proxy.decision.addresses import judge_ips

log = logging.getLogger("egresslaw.lane")

TTL = 5
MAX_PENDING = 256
MAX_REMEMBERED = 4096


class DnsFront(asyncio.DatagramProtocol):
    """`await DnsFront.start(...)`: listening on (host, port 0 = any free port); `.address` says where."""

    def __init__(self, *, policy: Callable[[], Any], resolve: Callable[[str, int], Awaitable[Sequence[str]]], timeout: float,
                 rewrite: Mapping[str, str] | None = None) -> None:
        self.policy = policy
        self.resolve = resolve
        self.timeout = timeout
        self.rewrite = dict(rewrite or {})  # test routing: a judged name answered with this loopback address instead
        self.refusals: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()  # name -> (reason, detail, when)
        self.transport: asyncio.DatagramTransport | None = None
        self.address: tuple[str, int] | None = None
        self._pending = 0
        self.answered = 0

    @classmethod
    async def start(cls, host: str, port: int, **kwargs: Any) -> DnsFront:
        loop = asyncio.get_running_loop()
        front = cls(**kwargs)
        transport, _ = await loop.create_datagram_endpoint(lambda: front, local_addr=(host, port))
        sock = transport.get_extra_info("sockname")
        front.address = (sock[0], sock[1])
        return front

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self._pending >= MAX_PENDING:
            return
        self._pending += 1
        task = asyncio.ensure_future(self._answer(data, addr))
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future) -> None:
        self._pending -= 1
        if not task.cancelled() and task.exception() is not None:
            log.error("the lane's DNS front failed on a query (%s)", task.exception().__class__.__name__)

    def refusal(self, name: str) -> tuple[str, str | None] | None:
        """Why the last lookup of `name` was refused (None: it was not)."""
        hit = self.refusals.get(name.rstrip(".").lower())
        return (hit[0], hit[1]) if hit is not None else None

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return
        reply = dns.message.make_response(query)
        reply.flags |= dns.flags.RA
        if len(query.question) != 1:
            reply.set_rcode(dns.rcode.FORMERR)
            return self._send(reply, addr)
        question = query.question[0]
        if question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            for ip in await self._judged(question.name.to_text(omit_final_dot=True)):
                if (ipaddress.ip_address(ip).version == 4) == (question.rdtype == dns.rdatatype.A):
                    reply.answer.append(dns.rrset.from_text(question.name, TTL, "IN", question.rdtype, ip))
        self.answered += 1
        self._send(reply, addr)

    async def _judged(self, name: str) -> tuple[str, ...]:
        name = name.rstrip(".").lower()
        policy = self.policy()
        if policy is None:
            return ()
        try:
            ips = tuple(await asyncio.wait_for(self.resolve(name, 0), self.timeout))
        except Exception:
            ips = ()
        if not ips:
            self._remember(name, "resolve-failed", None)
            return ()
        verdict = judge_ips(policy.artifact, DEFAULT_WORKER, ips)  # the worker every profile's request is judged by
        if not verdict.allowed:
            if self._remember(name, verdict.reason, verdict.detail):
                log.warning("lane DNS front: refused the answers for `%s` (%s)", name, verdict.reason)
            return ()
        self.refusals.pop(name, None)
        if name in self.rewrite:
            return (self.rewrite[name],)
        return ips

    def _remember(self, name: str, reason: str, detail: str | None) -> bool:
        """Keep why `name` was refused; True when that is news (not the same reason within the last minute)."""
        old = self.refusals.get(name)
        now = time.time()
        news = old is None or old[0] != reason or now - old[2] > 60
        self.refusals[name] = (reason, detail, now if news else old[2])
        self.refusals.move_to_end(name)
        while len(self.refusals) > MAX_REMEMBERED:
            self.refusals.popitem(last=False)
        return news

    def _send(self, reply: dns.message.Message, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply.to_wire(), addr)
