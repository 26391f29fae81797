"""`budget = {requests, bytes, window}` (docs/budget.md, "Declaring caps") -> the artifact's Budget; every mistake is
one located EL0049 with a fix; a subject without a budget compiles to what it always did; and under the lock, a
budget that may admit more inside a published window is a widening, one that admits less is not."""

from __future__ import annotations

import math

import pytest

from compiler.artifact import Budget
from compiler.budget import BudgetValueError, budget_widening, parse_size, parse_window, windows_meeting
from compiler.compile import compile_text
from compiler.fmt import format_source
from compiler.lock import apply_lock, budget_widenings
from compiler.parser import parse_source

HEAD = 'egresslaw 1\nworkspace "acme"\ncatalog "2026.11"\n\n'


def policy(profile_budget: str = "", connection_budget: str = "") -> str:
    """A trusted profile and a connection; each budget line goes on line 9 (profile) or 14 (connection)."""
    return (HEAD
            + 'sandbox_profile "builder" {\n  trust = "trusted"\n  provider = "gvisor@2026.10.1"\n'
            + '  network = {"type": "limited", "allowed_hosts": ["api.github.com"]}\n'
            + f"  {profile_budget}\n}}\n\n"
            + 'connection "github" {\n  credential = "github-token"\n'
            + f"  {connection_budget}\n"
            + '  egress "issues" {\n    host = "api.github.com"\n    methods = ["GET"]\n  }\n}\n')


def compiled(text: str):
    result = compile_text(text)
    assert result.ok, [(d.code, d.message) for d in result.diagnostics]
    return result.artifact


def test_both_spellings_compile_to_the_budget_on_profiles_and_connections():
    artifact = compiled(policy('budget = {requests = 10000, bytes = "64MiB", window = "1h"}',
                               'budget = {"requests": 500, "window": "15m"}'))
    assert artifact.profile("builder").budget == Budget(window=3600, requests=10000, bytes=64 * 1024 * 1024)
    assert artifact.connection("github").budget == Budget(window=900, requests=500)
    # whole numbers: seconds and bytes; a cap left out is absent from the JSON, not null
    artifact = compiled(policy("budget = {bytes: 4096, window: 86400}"))
    assert artifact.profile("builder").budget == Budget(window=86400, bytes=4096)
    assert '"budget":{"bytes":4096,"window":86400}' in artifact.to_json()


def test_a_policy_without_a_budget_compiles_to_what_it_always_did():
    plain, budgeted = compiled(policy()), compiled(policy(connection_budget='budget = {requests = 1, window = "1s"}'))
    assert "budget" not in plain.to_json()
    # the budget changes the connection and nothing else: the profile serializes as it did without one
    assert plain.profile("builder") == budgeted.profile("builder")
    assert plain.connection("github") == budgeted.connection("github").model_copy(update={"budget": None})
    assert plain.digest != budgeted.digest


@pytest.mark.parametrize(("text", "seconds"), [
    ("1s", 1), ("30s", 30), ("15m", 900), ("1h", 3600), ("1d", 86400), ("30d", 2592000), ("3600", 3600), (60, 60),
])
def test_windows(text, seconds):
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["0s", 0, "31d", 2592001, "1w", "1.5h", "h", "1 h", "-1s", "", "1H", True])
def test_windows_refused(text):
    with pytest.raises(BudgetValueError) as info:
        parse_window(text)
    assert info.value.help


@pytest.mark.parametrize(("text", "size"), [
    ("512KiB", 512 * 1024), ("64MiB", 64 * 1024**2), ("1GiB", 1024**3), ("1B", 1), ("4096", 4096), (1, 1),
    ("64 MiB", 64 * 1024**2),
])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "hint"), [
    ("64MB", '"64MiB"'), ("64k", '"64KiB"'), ("1gb", '"1GiB"'), ("0", ""), (0, ""), ("1.5MiB", ""), ("64mib", ""),
    ("MiB", ""), (2**53 + 1, ""),
])
def test_sizes_refused(text, hint):
    with pytest.raises(BudgetValueError) as info:
        parse_size(text)
    assert hint in info.value.help


# (budget as written, where the one diagnostic points (line, column), words of its message)
REFUSED = [
    ('budget = {requests = 0, window = "1h"}', (9, 24), "at least 1 request"),
    ('budget = {requests = -5, window = "1h"}', (9, 24), "at least 1 request"),
    ('budget = {requests = 1.5, window = "1h"}', (9, 24), "not a whole number"),
    ('budget = {requests = "100", window = "1h"}', (9, 24), "whole number"),
    ('budget = {bytes = 0, window = "1h"}', (9, 21), "at least 1 byte"),
    ('budget = {bytes = "64MB", window = "1h"}', (9, 21), "not a size"),
    ('budget = {bytes = [1], window = "1h"}', (9, 21), "must be a size"),
    ('budget = {requests = 10, window = "31d"}', (9, 37), "outside 1 second to 30 days"),
    ('budget = {requests = 10, window = 0}', (9, 37), "outside 1 second to 30 days"),
    ('budget = {requests = 10, window = "1w"}', (9, 37), "not a duration"),
    ('budget = {requests = 10, window = true}', (9, 37), "must be a duration"),
    ('budget = {requests = 10}', (9, 3), "no `window`"),
    ('budget = {window = "1h"}', (9, 3), "caps nothing"),
    ('budget = {}', (9, 3), "caps nothing"),
    ('budget = {requests = 10, window = "1h", burst = 5}', (9, 43), "unknown key `burst`"),
    ('budget = {requests = 10, windw = "1h"}', (9, 28), "unknown key `windw`"),
    ('budget = {requests = 10, requests = 20, window = "1h"}', (9, 28), "given twice"),
    ('budget = 100', (9, 12), "must be an object"),
    ('budget = ["1h"]', (9, 12), "must be an object"),
]


@pytest.mark.parametrize(("budget", "where", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_every_refusal_is_a_located_el0049_with_a_fix(budget, where, words):
    result = compile_text(policy(budget))
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert [d.code for d in errors][:1] == ["EL0049"] and {d.code for d in errors} == {"EL0049"}, errors
    first = errors[0]
    assert (first.span.line, first.span.column) == where, first
    assert words in first.message and first.help, first
    assert not result.ok


def test_a_connection_budget_is_refused_where_it_is_written():
    result = compile_text(policy(connection_budget='budget = {"requests": 500}'))
    (diag,) = [d for d in result.diagnostics if d.severity == "error"]
    assert (diag.code, diag.span.line, diag.span.column) == ("EL0049", 14, 3) and "connection `github`" in diag.message


def test_fmt_round_trips_a_budget():
    text = policy('budget = {requests = 10000, bytes = "64MiB", window = "1h"}  # caps',
                  'budget = {"requests": 500, "window": "15m"}')
    tree, problems = parse_source(text, "policy.egress")
    assert not problems
    formatted = format_source(tree)
    assert "# caps" in formatted and format_source(parse_source(formatted, "policy.egress")[0]) == formatted
    assert compiled(formatted).digest == compiled(text).digest


# Widening: old budget, new budget, whether the new one may admit more in one of the old one's windows.
WIDENING = [
    (Budget(window=3600, requests=100), Budget(window=3600, requests=101), True),  # a cap raised
    (Budget(window=3600, requests=100), None, True),  # the budget dropped
    (Budget(window=3600, requests=100, bytes=1000), Budget(window=3600, bytes=1000), True),  # a cap dropped
    (Budget(window=3600, requests=100), Budget(window=60, requests=100), True),  # 60 windows per published hour
    (Budget(window=3600, requests=100), Budget(window=5400, requests=100), True),  # an hour can meet two 90m windows
    (Budget(window=3600, bytes=1000), Budget(window=3600, bytes=1001), True),
    (Budget(window=3600, requests=100), Budget(window=3600, requests=99), False),  # lowered
    (Budget(window=3600, requests=100), Budget(window=3600, requests=100, bytes=5), False),  # a cap added
    (None, Budget(window=3600, requests=100), False),  # a budget added
    (Budget(window=3600, requests=100), Budget(window=86400, requests=100), False),  # each hour lies inside one day
    (Budget(window=3600, requests=100), Budget(window=900, requests=25), False),  # four quarters of 25
    (Budget(window=3600, requests=100), Budget(window=5400, requests=50), False),  # at most two 90m windows of 50
    (Budget(window=3600, requests=100), Budget(window=900, requests=26), True),
]


@pytest.mark.parametrize(("old", "new", "widens"), WIDENING)
def test_budget_widening(old, new, widens):
    assert bool(budget_widening(old, new)) is widens


def test_windows_meeting_is_never_below_what_aligned_windows_meet():
    for old in (60, 90, 3600, 5400, 86400):
        for new in (45, 60, 90, 900, 3600, 5400, 86400):
            starts = range(0, math.lcm(old, new), old)  # every old window, up to where both alignments repeat
            worst = max((start + old - 1) // new - start // new + 1 for start in starts)
            assert windows_meeting(old, new) >= worst, (old, new)


def _published_then(before: str, after: str) -> list[tuple[str, str]]:
    """Compile `before`, publish it in a lock, compile `after` against that lock: the budget widenings found."""
    first = apply_lock(compiled(before), None)
    second = apply_lock(compiled(after), first.lock)
    assert second.previous is not None
    return budget_widenings(second.previous, second.artifact)


def test_the_lock_names_each_subject_whose_budget_widened():
    before = policy('budget = {requests = 100, window = "1h"}', 'budget = {bytes = "1MiB", window = "1h"}')
    found = _published_then(before, policy('budget = {requests = 101, window = "1h"}', ""))
    assert [s for s, _ in found] == ["sandbox_profile:builder", "connection:github"]
    assert "101 requests per 1h" in found[0][1] and "drops its budget" in found[1][1]
    assert _published_then(before, policy('budget = {requests = 100, window = "1m"}',
                                          'budget = {bytes = "1MiB", window = "1h"}')) == [
        ("sandbox_profile:builder", "admits more per window: budget 100 requests per 1m, was 100 requests per 1h")]


def test_the_lock_finds_no_widening_when_budgets_only_narrow():
    before = policy('budget = {requests = 100, window = "1h"}', 'budget = {bytes = "1MiB", window = "1h"}')
    after = policy('budget = {requests = 50, bytes = "1GiB", window = "1d"}',
                   'budget = {requests = 5, bytes = "512KiB", window = "1h"}')
    assert _published_then(before, after) == []
    assert _published_then(policy(), before) == []  # a budget added to subjects that had none
