"""The budget's enforcement module (egress_proxy/front/budget.py): what a request costs, byte for byte as
docs/budget.md writes it; who is charged; the ledgers (SQLite and PostgreSQL) refusing the first request over a cap,
all or nothing across subjects, never over the cap when processes charge the same file at once, and keeping their
counts across a reopen."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import stat
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.artifact import Budget
from egress_proxy.decision.types import Decision, Lease, Request
from egress_proxy.errors import EgressError
from egress_proxy.front.admit import Ask
from egress_proxy.front.budget import (
    TABLE,
    Charged,
    LazyLedger,
    LedgerError,
    PostgresLedger,
    SqliteLedger,
    open_ledger,
    request_cost,
    subjects_charged,
    window_start,
)

DAY = 86400
HOUR = 3600


def plain(method="GET", target="/a?b=c", headers=(), has_body=False):
    return Ask(request=Request(method=method, scheme="http", host="pkgs.example", port=80, target=target, headers=tuple(headers),
                               host_header="pkgs.example", has_body=has_body))


def test_a_requests_cost_is_its_http1_serialization_with_the_declared_body_length():
    headers = [("Host", "ignored.example"), ("Accept", "*/*"), ("Content-Length", "12")]
    wire = b"POST /a?b=c HTTP/1.1\r\nhost: pkgs.example:80\r\nAccept: */*\r\nContent-Length: 12\r\n\r\n"
    assert request_cost(plain("POST", headers=headers, has_body=True)) == len(wire) + 12
    assert request_cost(plain()) == len(b"GET /a?b=c HTTP/1.1\r\nhost: pkgs.example:80\r\n\r\n")
    assert request_cost(Ask(authority="api.example:443", host="api.example", port=443)) == len(b"CONNECT api.example:443 HTTP/1.1\r\n\r\n")
    # a non-ASCII byte counts as what it is on the wire, never less
    assert request_cost(plain(target="/\u00e9")) == len("GET /\u00e9 HTTP/1.1\r\nhost: pkgs.example:80\r\n\r\n".encode())


def _wire_length(method, target, host, port, headers, body):
    """docs/budget.md's serialization written out, encoded whole (the reference the counting must equal)."""
    head = f"{method} {target} HTTP/1.1\r\nhost: {host}:{port}\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers if k.lower() != "host" and not k.startswith(":")) + "\r\n"
    return len(head.encode("utf-8", "surrogateescape")) + body


_text = st.text(st.sampled_from("aZ09-/?=:; \u00e9\u20ac\U0001f600\udcff\u212a"), max_size=12)
_name = st.one_of(st.sampled_from(["Host", "HOST", "host", ":authority", "content-length", "Content-Length", "x-a", "\u212aey"]), _text)


@settings(max_examples=300, deadline=None)
@given(method=_text, target=_text, host=_text, port=st.integers(0, 65535),
       headers=st.lists(st.tuples(_name, _text), max_size=6), length=st.sampled_from([None, "0", "17", " 17 "]))
def test_the_counted_cost_equals_the_serialization_encoded_whole(method, target, host, port, headers, length):
    # non-ASCII (2-, 3-, 4-byte), a surrogate escape, the Kelvin sign (lowercases to an ASCII k) and every header the
    # count treats apart: the fast path for ASCII text must give what the whole serialization encodes to
    if length is not None:
        headers = [*headers, ("Content-Length", length)]
    declared = {v.strip() for k, v in headers if k.lower() == "content-length"}
    body = int(next(iter(declared))) if len(declared) == 1 and next(iter(declared)).isdigit() else None  # digits: ASCII here
    got = request_cost(Ask(request=Request(method=method, scheme="http", host=host, port=port, target=target, headers=tuple(headers),
                                           host_header=host, has_body=True)))
    assert got == (None if body is None else _wire_length(method, target, host, port, headers, body))


@pytest.mark.parametrize("headers", [
    [("transfer-encoding", "chunked")],
    [],  # HTTP/2 without content-length
    [("content-length", "5"), ("content-length", "6")],
    [("content-length", "-1")],
    [("content-length", "\u0661")],  # a digit, not an ASCII one
])
def test_a_body_of_undeclared_length_has_no_cost(headers):
    assert request_cost(plain("POST", headers=headers, has_body=True)) is None


def test_windows_are_aligned():
    assert window_start(1_000_000_123.9, 3600) == 1_000_000_123 - 1_000_000_123 % 3600
    assert window_start(7199.99, 3600) == 3600 and window_start(7200, 3600) == 7200


def test_only_subjects_that_declare_a_budget_are_charged_and_a_brokered_request_names_its_carrier():
    from tests.egress_proxy import builders as b

    cap = Budget(window=60, requests=1)
    conn = b.connection("gh", [b.rule("r", "api.example", "/", ["GET"])]).model_copy(update={"budget": cap})
    free = b.connection("free", [b.rule("r", "free.example", "/", ["GET"])])
    art = b.artifact(connections=[conn, free], profiles=[b.profile("p", [("api.example", 443)], brokers=["gh", "free"])])
    lease = Lease("agent", "p", None, 0)
    assert subjects_charged(art, lease, Decision(True, "allowed")) == []
    assert subjects_charged(art, lease, Decision(True, "allowed", broker="gh")) == [("connection:gh", cap)]
    assert subjects_charged(art, lease, Decision(True, "allowed", broker="free")) == []
    assert subjects_charged(art, Lease("agent", None, "gh", 0), None) == [("connection:gh", cap)]


def test_a_reloaded_artifact_is_charged_its_own_budgets_never_the_last_ones():
    from tests.egress_proxy import builders as b

    lease = Lease("agent", "p", None, 0)
    first = b.artifact(profiles=[b.profile("p", [("api.example", 443)]).model_copy(update={"budget": Budget(window=60, requests=1)})])
    assert subjects_charged(first, lease, None) == [("profile:p", Budget(window=60, requests=1))]
    raised = first.model_copy(update={"sandbox_profiles": tuple(p.model_copy(update={"budget": Budget(window=60, requests=9)})
                                                                for p in first.sandbox_profiles)})
    dropped = first.model_copy(update={"sandbox_profiles": tuple(p.model_copy(update={"budget": None}) for p in first.sandbox_profiles)})
    assert subjects_charged(raised, lease, None) == [("profile:p", Budget(window=60, requests=9))]
    assert subjects_charged(dropped, lease, None) == []
    assert subjects_charged(first, lease, None) == [("profile:p", Budget(window=60, requests=1))]  # and back


def test_a_denial_says_which_cap_which_window_and_when_it_resets():
    got = Charged(False, "profile:builder", "requests", 10_000, 3600, 1_796_551_200, 1_796_554_800)
    assert got.detail() == "profile `builder`: 10,000 requests per 1h window used; resets at 2026-12-06T11:00:00Z"
    assert got.retry_after(1_796_554_799.2) == 1 and got.retry_after(1_796_551_200) == 3600
    assert got.event() == {"window": 3600, "start": 1_796_551_200, "resets": 1_796_554_800, "cap": "requests", "limit": 10_000}


def test_the_sqlite_ledger_refuses_the_first_charge_over_a_cap_all_or_nothing_and_keeps_its_counts(tmp_path):
    path = tmp_path / "budget.db"
    ledger = SqliteLedger(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    now = float(window_start(time.time(), DAY) + 10)  # well inside one window
    small, big = Budget(window=DAY, requests=2), Budget(window=DAY, requests=100, bytes=1000)
    assert ledger.charge([("profile:p", big), ("connection:c", small)], 400, now).ok
    assert ledger.charge([("profile:p", big), ("connection:c", small)], 400, now).ok
    refused = ledger.charge([("profile:p", big), ("connection:c", small)], 1, now)
    assert (refused.ok, refused.subject, refused.cap, refused.limit, refused.used) == (False, "connection:c", "requests", 2, 2)
    assert ledger.used("profile:p", DAY, now) == (2, 800)  # the profile was not charged for the refused request
    over = ledger.charge([("profile:p", big)], 201, now)
    assert (over.ok, over.cap, over.used, over.cost) == (False, "bytes", 800, 201)
    assert ledger.charge([("profile:p", big)], 200, now).ok  # exactly to the cap
    assert not ledger.charge([("profile:q", big)], 1001, now).ok  # a cost no window holds, even an empty one
    assert ledger.used("profile:q", DAY, now) == (0, 0)
    ledger.close()
    again = open_ledger(str(path))
    assert again.used("profile:p", DAY, now) == (3, 1000) and not again.charge([("profile:p", big)], 1, now).ok
    assert again.charge([("profile:p", big)], 0, now + DAY).ok  # the next window starts from nothing


def test_ended_windows_are_pruned(tmp_path):
    ledger = SqliteLedger(tmp_path / "budget.db")
    cap = Budget(window=60, requests=5)
    assert ledger.charge([("profile:p", cap)], 1, 1_000_000.0).ok
    assert ledger.charge([("profile:p", cap)], 1, 2_000_000.0).ok  # long after: the first window's row goes
    rows = sqlite3.connect(tmp_path / "budget.db").execute(f"SELECT start FROM {TABLE}").fetchall()
    assert rows == [(window_start(2_000_000.0, 60),)]


def test_a_ledger_that_cannot_be_opened_names_the_file_and_a_fix(tmp_path):
    (tmp_path / "not-a-db").write_bytes(b"this is not a SQLite file, " * 100)
    for address in (tmp_path / "missing-dir" / "budget.db", tmp_path / "not-a-db"):
        with pytest.raises(LedgerError) as err:
            open_ledger(str(address))
        assert str(address) in err.value.message and err.value.help
    assert issubclass(LedgerError, EgressError)


@pytest.mark.parametrize("address", [
    "postgresql+psycopg://u:hunter2@db.example/budget",
    "mysql://u:hunter2@db.example/budget",
    "sqlite:///budget.db?password=hunter2",
    "redis://:hun/ter2@db.example:6379/0",
    "https://hunter2@db.example/budget",
])
def test_a_store_url_of_another_scheme_is_refused_without_its_password_and_creates_no_file(address, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LedgerError) as err:
        open_ledger(address)
    said = f"{err.value} {err.value.message} {err.value.help}"
    assert "postgresql://" in said and "file" in said  # the supported forms
    assert "hunter2" not in said and "hun/ter2" not in said and "ter2" not in said
    with pytest.raises(LedgerError) as lazy:
        LazyLedger(address).charge([("profile:p", Budget(window=60, requests=1))], 1, 0.0)
    assert "ter2" not in f"{lazy.value} {lazy.value.help} {LazyLedger(address).shown}"
    assert list(tmp_path.rglob("*")) == []


def _charge_many(path: str, budget: Budget, n: int, now: float, ready, go, out) -> None:
    ledger = SqliteLedger(path)
    ready.put(True)
    go.wait(60)
    admitted = sum(ledger.charge([("profile:p", budget)], 1, now).ok for _ in range(n))
    ledger.close()  # a graceful stop: what it holds unspent goes back
    out.put(admitted)


def _race(path: str, budget: Budget, procs: int, each: int, now: float) -> list[int]:
    """`procs` processes charging `each` requests of one key at once, each with its own ledger on `path`."""
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    running = [ctx.Process(target=_charge_many, args=(path, budget, each, now, ready, go, out)) for _ in range(procs)]
    for p in running:
        p.start()
    for _ in running:
        ready.get(timeout=120)
    go.set()
    admitted = [out.get(timeout=120) for _ in running]
    for p in running:
        p.join(60)
    return admitted


def test_processes_sharing_a_sqlite_ledger_never_admit_more_than_the_cap_and_a_small_cap_exactly(tmp_path):
    now = float(window_start(time.time(), DAY) + 10)
    small = str(tmp_path / "small.db")
    assert sum(_race(small, Budget(window=DAY, requests=3), 2, 5, now)) == 3  # the 4th refused, whoever asks
    assert SqliteLedger(small).used("profile:p", DAY, now) == (3, 3)
    # blocks: each process holds at most 1/8 of what was left (25 of 200), so a refusal comes at most 2 × 25 early
    cap = Budget(window=DAY, requests=200, bytes=10**6)
    path = str(tmp_path / "budget.db")
    admitted = sum(_race(path, cap, 3, 100, now))
    assert 200 - 2 * 25 <= admitted <= 200
    assert SqliteLedger(path).used("profile:p", DAY, now) == (admitted, admitted)  # closed: what was not spent came back


def test_a_reservation_counts_as_used_until_given_back_and_a_restart_keeps_the_counts(tmp_path):
    path = tmp_path / "budget.db"
    now = float(window_start(time.time(), DAY) + 10)
    cap = Budget(window=DAY, requests=1000)  # 1000 left: a block of 64 (at most 1/8 of it, at most 64)
    one = SqliteLedger(path)
    assert one.charge([("profile:p", cap)], 50, now).ok and one.used("profile:p", DAY, now) == (1, 50)
    other = SqliteLedger(path)  # another process: the block is taken (bytes, uncapped, counted as spent)
    assert other.used("profile:p", DAY, now) == (64, 50)
    assert all(one.charge([("profile:p", cap)], 50, now).ok for _ in range(63))  # spent locally
    assert other.used("profile:p", DAY, now) == (64, 50)  # not written yet: uncapped bytes come with the next block
    assert one.charge([("profile:p", cap)], 50, now).ok and other.used("profile:p", DAY, now) == (64 + 64, 65 * 50)
    one.close()  # a graceful stop gives back the 63 it did not spend
    assert other.used("profile:p", DAY, now) == (65, 65 * 50)
    killed = SqliteLedger(path)
    assert killed.charge([("profile:p", cap)], 1, now).ok  # then `kill -9`: never closed
    del killed
    again = SqliteLedger(path)  # a restart: the window's row kept, the killed block counted as used
    assert again.used("profile:p", DAY, now)[0] == 65 + 64  # min(64, 935 // 8)


def test_one_process_spends_its_blocks_exactly_to_the_cap_across_two_keys_all_or_nothing(tmp_path):
    path = tmp_path / "budget.db"
    now = float(window_start(time.time(), DAY) + 10)
    profile, carrier = Budget(window=DAY, requests=1000), Budget(window=DAY, requests=100, bytes=10**6)
    ledger, other = SqliteLedger(path), SqliteLedger(path)
    both = [("profile:p", profile), ("connection:c", carrier)]
    assert ledger.charge(both, 7, now).ok
    assert other.used("connection:c", DAY, now) == (100 // 8, 64 * 7)  # a block: 1/8 of what was left, 64 costs
    assert sum(ledger.charge(both, 7, now).ok for _ in range(150)) == 99  # its own blocks never refuse early
    assert ledger.used("profile:p", DAY, now) == (100, 700) and ledger.used("connection:c", DAY, now) == (100, 700)
    bytes_only = Budget(window=DAY, bytes=1000)  # blocks of 125 bytes, spent 100 at a time: to the byte
    assert [ledger.charge([("profile:b", bytes_only)], 100, now).ok for _ in range(11)] == [True] * 10 + [False]
    # what it holds unspent (115 bytes of a 125-byte block) is no one's: a request that needs all the rest is admitted
    assert [ledger.charge([("profile:e", bytes_only)], cost, now).ok for cost in (10, 990, 1)] == [True, True, False]
    ledger.close()
    assert other.used("profile:p", DAY, now) == (100, 700) and other.used("connection:c", DAY, now) == (100, 700)
    assert other.used("profile:b", DAY, now) == (10, 1000)


def test_a_reload_that_lowers_a_cap_gives_the_block_back_and_enforces_the_new_cap_exactly(tmp_path):
    ledger = SqliteLedger(tmp_path / "budget.db")
    now = float(window_start(time.time(), DAY) + 10)
    assert ledger.charge([("profile:p", Budget(window=DAY, requests=1000, bytes=10**6))], 10, now).ok  # holds 63 more
    lowered = Budget(window=DAY, requests=3, bytes=10**6)
    assert [ledger.charge([("profile:p", lowered)], 10, now).ok for _ in range(3)] == [True, True, False]
    assert ledger.used("profile:p", DAY, now) == (3, 30)
    bytes_cap = Budget(window=DAY, bytes=25)  # the same window, a bytes cap alone: 30 bytes already there
    refused = ledger.charge([("profile:p", bytes_cap)], 1, now)
    assert (refused.ok, refused.cap, refused.used) == (False, "bytes", 30)
    # the next window: what this process held in the last one goes back, the new one starts from nothing
    assert ledger.charge([("profile:p", lowered)], 10, now + DAY).ok
    assert ledger.used("profile:p", DAY, now) == (3, 30) and ledger.used("profile:p", DAY, now + DAY) == (1, 10)
    ledger.close()
    assert SqliteLedger(tmp_path / "budget.db").used("profile:p", DAY, now + DAY) == (1, 10)


def _rows(path) -> list[tuple[int, int]]:
    with sqlite3.connect(path) as db:
        return db.execute(f"SELECT span, start FROM {TABLE} ORDER BY span, start").fetchall()


def test_a_reload_to_a_longer_window_keeps_what_the_old_windows_counted_even_after_they_end(tmp_path):
    path = tmp_path / "budget.db"
    ten = float(window_start(time.time(), DAY) + 10 * HOUR)  # 10:00 of a day
    ledger, other = SqliteLedger(path), SqliteLedger(path)  # `other`: another process on the file
    assert [ledger.charge([("profile:p", Budget(window=HOUR, requests=3))], 1, ten + 600).ok for _ in range(4)] == [True] * 3 + [False]
    # reloaded to 3 per 1d (not a widening): the day holds the 10:00 hour's 3, in either process
    day = Budget(window=DAY, requests=3)
    assert not ledger.charge([("profile:p", day)], 1, ten + 1800).ok and not other.charge([("profile:p", day)], 1, ten + 1800).ok
    # the hour ends and both prune (more than PRUNE_EVERY after their last): the hour's row stays while the day is live
    for at in (ten + HOUR + 600, ten + 2 * HOUR, ten + 13 * HOUR):
        assert not ledger.charge([("profile:p", day)], 1, at).ok and not other.charge([("profile:p", day)], 1, at).ok
    assert (HOUR, int(ten)) in _rows(path)
    assert ledger.charge([("profile:p", day)], 1, ten + DAY).ok  # the next day starts from nothing
    assert other.charge([("profile:p", day)], 1, ten + DAY + 2 * HOUR).ok  # its prune: the old day and hour go
    assert _rows(path) == [(DAY, int(ten) - 10 * HOUR + DAY)]


def test_a_reload_to_a_longer_window_gives_back_the_old_block_and_counts_the_rest_exactly(tmp_path):
    path = tmp_path / "budget.db"
    ten = float(window_start(time.time(), DAY) + 10 * HOUR)
    ledger = SqliteLedger(path)
    assert ledger.charge([("profile:p", Budget(window=HOUR, requests=1000))], 1, ten).ok  # spent 1, holds 63 more
    assert SqliteLedger(path).used("profile:p", HOUR, ten) == (64, 1)
    # reloaded to 100 per 1d: the hour's unspent block goes back, its one request counts in the day: 99 more, exactly
    day = Budget(window=DAY, requests=100)
    assert sum(ledger.charge([("profile:p", day)], 1, ten + 60).ok for _ in range(120)) == 99
    ledger.close()
    assert SqliteLedger(path).used("profile:p", HOUR, ten) == (1, 1)


def test_a_reload_to_two_hours_at_a_lower_cap_counts_the_hours_it_holds_across_processes(tmp_path):
    path = str(tmp_path / "budget.db")
    ten = float(window_start(time.time(), DAY) + 10 * HOUR)  # 10:00-12:00 is one 2h window
    assert _race(path, Budget(window=HOUR, requests=3), 1, 5, ten + 600) == [3]
    two_hours = Budget(window=2 * HOUR, requests=2)
    assert sum(_race(path, two_hours, 2, 5, ten + 1800)) == 0  # 3 per 1h -> 2 per 2h: the window already holds 3
    assert sum(_race(path, two_hours, 2, 5, ten + HOUR + 1800)) == 0  # and still after the 10:00 hour ended
    assert sum(_race(path, two_hours, 2, 5, ten + 2 * HOUR + 10)) == 2  # 12:00: a new 2h window
    # an hour that counted 1 leaves the 2h window 1 more, whichever process asks and after the hour ends
    noon = ten + 4 * HOUR  # 14:00
    assert _race(path, Budget(window=HOUR, requests=3), 1, 1, noon + 600) == [1]
    assert sum(_race(path, two_hours, 2, 3, noon + HOUR + 600)) == 1


@pytest.fixture(scope="module")
def pg():
    from tests.pg_server import PgServer

    server = PgServer()
    server.start()
    yield server
    server.destroy()


@pytest.mark.slow
def test_the_postgresql_ledger_charges_the_same_way_and_fails_closed_when_the_database_goes(pg):
    url = pg.create_database()
    ledger = open_ledger(url)
    assert isinstance(ledger, PostgresLedger)
    now = float(window_start(time.time(), DAY) + 10)
    small, big = Budget(window=DAY, requests=2), Budget(window=DAY, bytes=1000)
    assert ledger.charge([("profile:p", big), ("connection:c", small)], 400, now).ok
    assert ledger.charge([("profile:p", big), ("connection:c", small)], 400, now).ok
    refused = ledger.charge([("profile:p", big), ("connection:c", small)], 1, now)
    assert (refused.ok, refused.subject, refused.cap) == (False, "connection:c", "requests")
    over = ledger.charge([("profile:p", big)], 201, now)
    assert (over.ok, over.subject, over.cap, over.used) == (False, "profile:p", "bytes", 800)
    other = open_ledger(url)  # another replica sees the same counts
    assert other.charge([("profile:p", big)], 200, now).ok and not ledger.charge([("profile:p", big)], 1, now).ok
    other.close()
    pg.stop()
    try:
        with pytest.raises(LedgerError) as err:
            ledger.charge([("profile:p", big)], 1, now)
        assert "pw" not in str(err.value)
    finally:
        pg.start()
    ledger.close()


@pytest.mark.slow
def test_the_postgresql_ledger_keeps_the_old_windows_counts_when_a_reload_lengthens_the_window(pg):
    url = pg.create_database()
    one, two = open_ledger(url), open_ledger(url)  # two replicas
    ten = float(window_start(time.time(), DAY) + 10 * HOUR)
    hourly = Budget(window=HOUR, requests=3)
    assert [one.charge([("profile:p", hourly)], 1, ten + 600).ok for _ in range(4)] == [True] * 3 + [False]
    day, two_hours = Budget(window=DAY, requests=3), Budget(window=2 * HOUR, requests=2)
    for at in (ten + 1800, ten + HOUR + 600, ten + 3 * HOUR):  # after 11:00 both have pruned: the 10:00 row stays
        assert not one.charge([("profile:p", day)], 1, at).ok and not two.charge([("profile:p", day)], 1, at).ok
    assert not two.charge([("connection:c", two_hours), ("profile:p", day)], 1, ten + HOUR + 700).ok
    # 3 per 1h -> 2 per 2h: an hour that counted 1 leaves the 2h window 1 more, after the hour ended too
    assert one.charge([("profile:q", hourly)], 1, ten + 600).ok
    assert [two.charge([("profile:q", two_hours)], 1, ten + HOUR + 600).ok for _ in range(2)] == [True, False]
    assert not one.charge([("profile:q", two_hours)], 1, ten + HOUR + 900).ok
    assert one.charge([("profile:p", day)], 1, ten + DAY).ok  # the next day starts from nothing
    one.close()
    two.close()


def test_the_audit_events_budget_holds_the_cap_and_nothing_else():
    from egress_proxy.audit.event import Event, EventError

    charged = Charged(False, "profile:p", "bytes", 2000, DAY, 0, DAY, used=10, cost=5000)
    event = Event.decided("request", "id", None, "deny", "budget-exceeded", budget=charged.event(), detail=charged.detail())
    assert event["budget"] == {"window": DAY, "start": 0, "resets": DAY, "cap": "bytes", "limit": 2000}
    for wrong in ({**charged.event(), "path": "/secret"}, {**charged.event(), "cap": "tokens"}, {**charged.event(), "limit": "2000"}):
        with pytest.raises(EventError):
            Event.decided("request", "id", None, "deny", "budget-exceeded", budget=wrong)
