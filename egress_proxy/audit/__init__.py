"""The audit: one line per decision, hash-chained under a key, checkpointed and rotatable.

- `event`   — the one typed, frozen audit `Event` (its constructors; the only thing the log accepts).
- `log`     — the writer (`AuditLog`, write-ahead, fsync policy, rotation) and the verifier of one chain.
- `verify`  — every log at a path: the chains of a fleet's worker processes checked as one record.
- `ocsf`    — one OCSF 1.3.0 record per line (`project`), the projection the exporter ships (docs/ocsf.md).
- `export`  — the exporter: every chain's lines as OCSF records in OTLP logs (HTTP/protobuf, gRPC) to a collector,
              from a durable checkpoint advanced only on the collector's acknowledgement (docs/audit-export.md).

Imports `custody.keys` (the audit key) and the decision's types and provenance (the product version `ocsf` names)
only from the rest of the project; never the edge or the runner.
"""
