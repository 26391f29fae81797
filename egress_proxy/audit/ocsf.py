"""OCSF 1.3.0 records projected from audit log lines (docs/audit-export.md, the class table in docs/ocsf.md).

    project(line)  # a parsed `egresslaw.audit/2` line (a dict) -> one OCSF record (a dict, JSON-ready)

A projection, never a new source: every record keeps the line's `mac` (`metadata.uid`), `seq`
(`metadata.sequence`), log id (`metadata.log_name`), event id (`metadata.correlation_uid`) and reason code
(`status_code`), and holds nothing the line does not hold.
"""

from __future__ import annotations

from typing import Any

OCSF_VERSION = "1.3.0"


def log_name(log_id: str | None) -> str:
    """`metadata.log_name` of a chain: `egresslaw.audit/<log id>`."""
    return f"egresslaw.audit/{log_id or 'unknown'}"


def project(line: dict[str, Any], *, log_id: str | None = None) -> dict[str, Any]:
    """The OCSF record of one audit line (`log_id`: the chain's, from its segment's `audit-open`)."""
    return {
        "metadata": {"uid": line.get("mac"), "sequence": line.get("seq"), "log_name": log_name(log_id),
                     "correlation_uid": line.get("id"), "version": OCSF_VERSION,
                     "product": {"name": "egresslaw", "vendor_name": "egresslaw"}},
        "status_code": line.get("reason"),
        "class_uid": 6002, "category_uid": 6, "activity_id": 99, "type_uid": 600299, "severity_id": 1,
        "time": 0,
    }
