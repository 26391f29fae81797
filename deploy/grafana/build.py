"""The egresslaw Grafana dashboard, built with Grafana's own model (grafana-foundation-sdk builders).

    python deploy/grafana/build.py > deploy/grafana/egresslaw.json

Edit this file, not the JSON: tests/deploy/test_dashboard.py checks the committed JSON is exactly what this prints,
that Grafana's dashboard model reads it back without losing or retyping a key, that every query parses as PromQL
and names only metrics egresslaw serves. Import: docs/operations.md "Dashboard".
"""

from __future__ import annotations

import json
import sys

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import plugins
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.models.common import (
    BigValueColorMode,
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import (
    Dashboard,
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

UID = "egresslaw"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'instance=~"$instance"'
RATE = "$__rate_interval"


def query(expr: str, legend: str = "", ref: str = "A") -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").ref_id(ref).datasource(DATASOURCE)


def series(title: str, description: str, unit: str, *queries: prometheus.Dataquery, width: int = 12, height: int = 8) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(width).height(height)
             .legend(common.VizLegendOptions().display_mode(LegendDisplayMode.TABLE).placement(LegendPlacement.BOTTOM).show_legend(True)
                     .calcs(["lastNotNull", "max"]))
             .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))
    for q in queries:
        panel = panel.with_target(q)
    return panel


def single(title: str, description: str, unit: str, expr: str, legend: str, width: int = 6) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).span(width).height(5)
            .graph_mode(BigValueGraphMode.AREA).color_mode(BigValueColorMode.VALUE)
            .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .with_target(query(expr, legend)))


def quantiles(metric: str, by: str = "") -> list[prometheus.Dataquery]:
    group = f"le{', ' + by if by else ''}"
    legend = f"p{{q}}{' {{' + by + '}}' if by else ''}"
    return [query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
                  legend.replace("{q}", str(int(q * 100))), ref)
            for q, ref in ((0.5, "A"), (0.9, "B"), (0.99, "C"))]


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("egresslaw")
        .uid(UID)
        .description("egresslaw proxy and lane: decisions, traffic, custody, policy, the audit log and its export (docs/operations.md)")
        .tags(["egresslaw"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .refresh("1m")
        .timezone("utc")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("instance").label("instance").datasource(DATASOURCE)
            .query("label_values(egresslaw_build_info, instance)").multi(True).include_all(True).all_value(".*")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
        )
    )
    board = board.with_row(dashboard.Row("Decisions"))
    board = board.with_panel(series(
        "Decisions by reason", "Every decision, by kind, decision and reason code (egresslaw_decisions_total).", "reqps",
        query(f"sum by (kind, decision, reason) (rate(egresslaw_decisions_total{{{SEL}}}[{RATE}]))", "{{kind}} {{decision}} {{reason}}")))
    board = board.with_panel(series(
        "Denials", "Denied decisions by reason.", "reqps",
        query(f'sum by (reason) (rate(egresslaw_decisions_total{{decision="deny", {SEL}}}[{RATE}]))', "{{reason}}")))
    board = board.with_panel(series(
        "Would deny (observe mode)", "Flows an observe-mode profile forwarded that enforcement would deny (alert EgresslawWouldDeny).", "reqps",
        query(f"sum by (kind, reason) (rate(egresslaw_would_deny_total{{{SEL}}}[{RATE}]))", "{{kind}} {{reason}}"), width=8))
    board = board.with_panel(series(
        "Budget denials", "Requests denied because a subject's budget was spent (reason budget-exceeded; docs/budget.md).", "reqps",
        query(f'sum by (kind) (rate(egresslaw_decisions_total{{decision="deny", reason="budget-exceeded", {SEL}}}[{RATE}]))', "{{kind}}"),
        width=8))
    board = board.with_panel(series(
        "Token mints", "The edge's calls to token endpoints; a deny is a failed mint (alert EgresslawMintFailing).", "reqps",
        query(f'sum by (decision, reason) (rate(egresslaw_decisions_total{{kind="mint", {SEL}}}[{RATE}]))', "{{decision}} {{reason}}"),
        width=8))
    board = board.with_row(dashboard.Row("Traffic"))
    board = board.with_panel(series(
        "Request latency", "HTTP requests, request headers to the audit event: quantiles of egresslaw_request_duration_seconds.", "s",
        *quantiles("egresslaw_request_duration_seconds")))
    board = board.with_panel(series(
        "Bytes relayed", "Body bytes, up (client to upstream) and down.", "Bps",
        query(f"sum by (direction) (rate(egresslaw_bytes_total{{{SEL}}}[{RATE}]))", "{{direction}}")))
    board = board.with_panel(series(
        "Open connections", "Client connections open now, per instance.", "short",
        query(f"sum by (instance) (egresslaw_open_connections{{{SEL}}})", "{{instance}}")))
    board = board.with_panel(series(
        "Failed outcomes", "Allowed flows that did not end delivered, by failure code.", "reqps",
        query(f'sum by (kind, failure) (rate(egresslaw_outcomes_total{{failure!="none", {SEL}}}[{RATE}]))', "{{kind}} {{failure}}")))
    board = board.with_row(dashboard.Row("Custody and policy"))
    board = board.with_panel(single(
        "Custody reachable", "1 while the custody store answers on every instance (alert EgresslawCustodyUnreachable).", "bool_yes_no",
        f"min(egresslaw_custody_reachable{{{SEL}}})", "custody"))
    board = board.with_panel(single(
        "Unproved artifacts", "Instances serving an artifact that is not all-proved (alert EgresslawUnprovedArtifact).", "short",
        f'count(egresslaw_build_info{{proved="false", {SEL}}}) or vector(0)', "unproved"))
    board = board.with_panel(series(
        "Reloads", "Artifact reloads by result; failed is a refusal of the proof gate (alert EgresslawReloadRefused).", "short",
        query(f"sum by (result) (increase(egresslaw_reloads_total{{{SEL}}}[{RATE}]))", "{{result}}"), width=12, height=5))
    board = board.with_panel(
        table.Panel().title("Build and artifact").description("What each instance runs and enforces (egresslaw_build_info).")
        .datasource(DATASOURCE).span(24).height(6).show_header(True)
        .with_target(query(f"egresslaw_build_info{{{SEL}}}", "{{instance}}").instant().format(PromQueryFormat.TABLE)))
    board = board.with_row(dashboard.Row("Audit log"))
    board = board.with_panel(series(
        "Audit write latency", "The audit writer's appends (write) and syncs (fsync).", "s",
        *quantiles("egresslaw_audit_write_seconds", "op")))
    board = board.with_panel(series(
        "Audit write failures", "Failed appends and syncs: the log then fails closed (alert EgresslawAuditWriteFailing).", "short",
        query(f"sum by (op) (increase(egresslaw_audit_write_failures_total{{{SEL}}}[{RATE}]))", "{{op}}")))
    board = board.with_row(dashboard.Row("Audit export"))
    board = board.with_panel(single(
        "Exporters up", "Instances whose audit exporter runs with fresh state, of those exporting.", "short",
        f"sum(egresslaw_audit_export_up{{{SEL}}})", "up"))
    board = board.with_panel(single(
        "Broken chains", "Chains whose export stopped at a break (alert EgresslawAuditExportBroken).", "short",
        f"sum(egresslaw_audit_export_broken{{{SEL}}})", "broken"))
    board = board.with_panel(single(
        "Gaps", "Segments deleted before they were exported, in the time range (alert EgresslawAuditExportGap).", "short",
        f"sum(increase(egresslaw_audit_export_gaps_total{{{SEL}}}[$__range]))", "gaps"))
    board = board.with_panel(single(
        "Rejected records", "Records the collector acknowledged as rejected, in the time range.", "short",
        f"sum(increase(egresslaw_audit_export_rejected_total{{{SEL}}}[$__range]))", "rejected"))
    board = board.with_panel(series(
        "Export lag", "Age of the oldest line the collector has not acknowledged (alert EgresslawAuditExportLagging).", "s",
        query(f"max by (instance) (egresslaw_audit_export_lag_seconds{{{SEL}}})", "{{instance}}"), width=8))
    board = board.with_panel(series(
        "Export backlog", "Bytes of the chains not yet acknowledged (alert EgresslawAuditExportBacklogGrowing).", "bytes",
        query(f"sum by (instance) (egresslaw_audit_export_backlog_bytes{{{SEL}}})", "{{instance}}"), width=8))
    board = board.with_panel(series(
        "Export throughput and failures", "Lines acknowledged, failed attempts and rejected records per second.", "short",
        query(f"sum(rate(egresslaw_audit_exported_records_total{{{SEL}}}[{RATE}]))", "exported", "A"),
        query(f"sum(rate(egresslaw_audit_export_failures_total{{{SEL}}}[{RATE}]))", "failed attempts", "B"),
        query(f"sum(rate(egresslaw_audit_export_rejected_total{{{SEL}}}[{RATE}]))", "rejected", "C"), width=8))
    return board


def canonical(data: dict) -> dict:
    """`data` read by Grafana's dashboard model and written back: panel options, field config and queries decoded by
    their plugin's model (timeseries, stat, table, prometheus), so the defaults a panel type adds are written out."""
    plugins.register_default_plugins()
    return json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))


def render() -> str:
    """The dashboard JSON as committed: the built model in canonical form, keys sorted, two-space indent, final newline."""
    built = json.loads(json.dumps(build().build(), cls=JSONEncoder))
    return json.dumps(canonical(built), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
