"""deploy/grafana/egresslaw.json against Grafana's own dashboard model, PromQL and the product's metrics.

What "validates" means here (grafana-foundation-sdk carries Grafana's schema as generated Python classes, with
no validator of its own, so the test makes one from them):

1. The committed JSON is exactly what deploy/grafana/build.py prints (built with the SDK's builders): nobody edits
   the JSON by hand, and the builders only emit fields the model has.
2. Grafana's model reads it back without losing a key or changing a value: `Dashboard.from_json` (with the panel
   and query plugins registered, so panel options, field config and Prometheus queries are decoded by their own
   models) then `to_json` gives the same document, compared with types (1 is not 1.0 nor True). `from_json`
   drops keys its model does not have, so a misspelt or unknown field anywhere the model reaches fails here.
3. Every value has the type the model declares for it (`from_json` does not check types): each attribute of the
   decoded objects against the annotation of its class's constructor (Optional, Union, Literal, list, dict, enums,
   nested models). A string where Grafana wants a number, or an enum value it does not have, fails here.
4. Every query parses as PromQL (`promtool check rules`, Grafana's variables replaced by what Grafana would
   interpolate) and names only metrics egresslaw serves (tests/deploy/metric_names.py); the panels cover every
   metric family the on-call engineer needs; panels do not overlap on the 24-column grid; every query uses the
   dashboard's Prometheus variable.

Not covered: Grafana's frontend migrations and rendering (no Grafana runs here), and options a panel plugin
accepts beyond the SDK's model of it.
"""

from __future__ import annotations

import copy
import enum
import importlib.util
import json
import types
import typing
from pathlib import Path

import pytest
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

from tests.deploy.metric_names import PROMTOOL, check_expressions, exposed, metric_names

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "deploy" / "grafana" / "egresslaw.json"
BUILD = ROOT / "deploy" / "grafana" / "build.py"
DOC = json.loads(BOARD.read_text())

plugins.register_default_plugins()


def _build_module() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("egresslaw_dashboard_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _panels(doc: dict) -> list[dict]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def _exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in _panels(doc) for t in p.get("targets", [])]


# -- 1. and 2.: the builders' output, read back by the model --------------------------------------------------


def test_the_committed_json_is_what_the_builder_prints():
    assert BOARD.read_text() == _build_module().render(), "run: python deploy/grafana/build.py > deploy/grafana/egresslaw.json"


def _strict_diff(a, b, path: str = "") -> list[str]:
    """Where two JSON documents differ, types included (json equality would take 1 == 1.0 == True)."""
    if type(a) is not type(b):
        return [f"{path or '/'}: {type(a).__name__} became {type(b).__name__}"]
    if isinstance(a, dict):
        out = [f"{path}/{k}: lost" for k in a.keys() - b.keys()] + [f"{path}/{k}: added" for k in b.keys() - a.keys()]
        return out + [d for k in a.keys() & b.keys() for d in _strict_diff(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items became {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _strict_diff(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} became {b!r}"]


def _round_trip(doc: dict) -> list[str]:
    return _strict_diff(doc, _build_module().canonical(copy.deepcopy(doc)))


def test_grafanas_model_reads_it_back_without_losing_or_retyping_a_key():
    assert _round_trip(DOC) == []


# -- 3. every value has the model's type ----------------------------------------------------------------------


def _conforms(value, ann, path: str) -> list[str]:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is typing.Any or ann is object:
        return _model_errors(value, path) if hasattr(value, "to_json") else []
    if origin in (typing.Union, types.UnionType):
        tries = [_conforms(value, a, path) for a in args]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if origin is typing.Literal:
        return [] if value in args and type(value) in {type(a) for a in args} else [f"{path}: {value!r} is not one of {args}"]
    if ann is type(None):
        return [] if value is None else [f"{path}: {value!r} where none is allowed"]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, not a list"]
        return [e for i, item in enumerate(value) for e in _conforms(item, args[0] if args else typing.Any, f"{path}/{i}")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, not an object"]
        return [e for k, item in value.items() for e in _conforms(item, args[1] if args else typing.Any, f"{path}/{k}")]
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        try:
            member = ann(value)
        except ValueError:
            return [f"{path}: {value!r} is not a {ann.__name__}"]
        return [] if type(value) in (ann, type(member.value)) else [f"{path}: {value!r} is not a {ann.__name__}"]
    if ann is float:
        return [] if isinstance(value, (int, float)) and not isinstance(value, bool) else [f"{path}: {value!r} is not a number"]
    if ann is int:
        return [] if isinstance(value, int) and not isinstance(value, bool) else [f"{path}: {value!r} is not an integer"]
    if ann in (str, bool):
        return [] if type(value) is ann else [f"{path}: {value!r} is not a {ann.__name__}"]
    if isinstance(ann, type):
        if not isinstance(value, ann):
            return [f"{path}: {type(value).__name__}, not a {ann.__name__}"]
        return _model_errors(value, path)
    raise AssertionError(f"{path}: an annotation this checker does not know: {ann!r}; teach it")


def _model_errors(obj, path: str = "") -> list[str]:
    """Every attribute of a decoded model object against its constructor's annotation, recursively."""
    hints = typing.get_type_hints(type(obj).__init__)
    errors = []
    for name, ann in hints.items():
        if name != "return":
            errors += _conforms(getattr(obj, name), ann, f"{path}.{name}")
    return errors


def test_every_value_has_the_type_grafanas_model_declares():
    model = Dashboard.from_json(copy.deepcopy(DOC))
    assert _model_errors(model) == []
    # the decoding reached the plugins' own models, so the check covers panel options and queries too
    kinds = {type(p.options).__module__.rsplit(".", 1)[1] for p in model.panels if getattr(p, "options", None) is not None}
    assert {"timeseries", "stat", "table"} <= kinds
    assert {type(t).__module__.rsplit(".", 1)[1] for p in model.panels for t in (getattr(p, "targets", None) or [])} == {"prometheus"}


def _panel(doc: dict, kind: str) -> dict:
    return next(p for p in doc["panels"] if p["type"] == kind)


BROKEN = [  # (what, mutation): each copy must be refused by the round trip or the type check
    ("a misspelt panel field", lambda d: _panel(d, "timeseries").__setitem__("titel", "x")),
    ("a misspelt query field", lambda d: _panel(d, "timeseries")["targets"][0].__setitem__("exprr", "up")),
    ("a misspelt legend option", lambda d: _panel(d, "timeseries")["options"]["legend"].__setitem__("placemnt", "right")),
    ("a misspelt field config", lambda d: _panel(d, "stat")["fieldConfig"]["defaults"].__setitem__("unti", "s")),
    ("a width as a string", lambda d: _panel(d, "timeseries")["gridPos"].__setitem__("w", "12")),
    ("an unknown legend mode", lambda d: _panel(d, "timeseries")["options"]["legend"].__setitem__("displayMode", "tabel")),
    ("an expression as a number", lambda d: _panel(d, "stat")["targets"][0].__setitem__("expr", 5)),
    ("a boolean as a string", lambda d: d["templating"]["list"][1].__setitem__("multi", "true")),
]


@pytest.mark.parametrize(("what", "mutate"), BROKEN, ids=[w for w, _ in BROKEN])
def test_a_broken_copy_is_refused(what, mutate):
    broken = copy.deepcopy(DOC)
    mutate(broken)
    assert _round_trip(broken) or _model_errors(Dashboard.from_json(copy.deepcopy(broken))), what


# -- 4. the queries ----------------------------------------------------------------------------------------------

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "6h", "$__interval": "1m", "$instance": ".*"}


def _interpolated(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a Grafana variable this test does not interpolate: {expr}"
    return expr


@pytest.mark.skipif(not Path(PROMTOOL).exists(), reason="promtool is not installed")
def test_every_query_parses_as_promql():
    exprs = [_interpolated(e) for e in _exprs(DOC)]
    done = check_expressions(exprs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in done.stdout
    assert check_expressions(["sum by (le (rate(egresslaw_bytes_total[5m]))"]).returncode != 0  # the check can fail


def test_every_metric_a_query_names_is_served():
    served = exposed()
    for panel in _panels(DOC):
        for target in panel.get("targets", []):
            used = metric_names(target["expr"])
            assert used and used <= served, (panel["title"], sorted(used - served))


def test_the_panels_cover_what_the_on_call_engineer_needs():
    used = set().union(*(metric_names(e) for e in _exprs(DOC)))
    exporter = {n for n in exposed() if n.startswith("egresslaw_audit_export")}
    needed = {"egresslaw_decisions_total", "egresslaw_would_deny_total", "egresslaw_request_duration_seconds_bucket",
              "egresslaw_bytes_total", "egresslaw_open_connections", "egresslaw_custody_reachable", "egresslaw_reloads_total",
              "egresslaw_build_info", "egresslaw_audit_write_seconds_bucket", "egresslaw_audit_write_failures_total",
              "egresslaw_outcomes_total", *exporter}
    assert needed <= used, sorted(needed - used)
    assert any('reason="budget-exceeded"' in e for e in _exprs(DOC))
    assert any('kind="mint"' in e for e in _exprs(DOC))
    assert sum("histogram_quantile(" in e for e in _exprs(DOC)) >= 6  # request and audit write latency, three quantiles each


def test_every_query_uses_the_dashboards_prometheus_variable():
    variables = {v["name"]: v for v in DOC["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for panel in _panels(DOC):
        assert panel["datasource"] == ref, panel["title"]
        assert panel["targets"] and all(t["datasource"] == ref for t in panel["targets"]), panel["title"]
        assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]
    assert metric_names(variables["instance"]["query"].removeprefix("label_values(").split(",")[0]) <= exposed()


def test_the_panels_fit_the_grid_without_overlapping():
    taken: dict[tuple[int, int], str] = {}
    for panel in DOC["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[(x, y)]}"
                taken[(x, y)] = panel["title"]
