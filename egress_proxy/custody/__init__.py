"""Custody: keys, leases and credentials, on the trusted side of the edge.

- `keys`      — the keys directory (custody, lease, audit keys; 0600, refused when wider).
- `lease`     — lease tokens: minted, verified in constant time, memoized.
- `secret`    — `Secret`: a credential in memory that never prints, and its needles for the scanner.
- `records`   — sealed records (AES-256-GCM, address-bound), the errors and the store's shared words.
- `sqlite`    — the embedded store: one SQLite file.
- `postgres`  — the store a fleet shares: PostgreSQL.
- `stores`    — `open_store`: which store a `--store` names.

Imports `decision.types` only from the rest of the project.
"""
