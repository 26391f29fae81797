"""What both front ends load before anything listens (egress_proxy/front/startup.py): bad test routing is a
StartupError naming the entry, and a taken address is named in the operating system's words."""

from __future__ import annotations

import socket

import pytest

from egress_proxy.front.startup import StartupError, bind_error, parse_connect_to, parse_resolve


def test_routing_entries_are_normalized_or_refused_by_name():
    assert parse_resolve(["API.Acme-Test.dev=127.0.0.1,::1"]) == {"api.acme-test.dev": ("127.0.0.1", "::1")}
    assert parse_connect_to(["api.acme-test.dev:443:127.0.0.1:8443"]) == {("api.acme-test.dev", 443): ("127.0.0.1", 8443)}
    for bad, parse in (("a=not-an-ip", parse_resolve), ("=1.2.3.4", parse_resolve), ("a:443:name:1", parse_connect_to), ("a:0:1.2.3.4:1", parse_connect_to)):
        with pytest.raises(StartupError) as refused:
            parse([bad])
        assert f"`{bad}`" in refused.value.message


def test_a_taken_address_is_named_in_the_systems_words():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert bind_error(held.getsockname()) == "address already in use"
