"""egresslaw: the thin CLI that wires catalog, compiler, proofs and egress_proxy together.

- `cli`           — the entry point: parse arguments, call one function per command, render.
- `commands/`     — one module per command family, discovered by name.
- `common`        — what every command shares: `CliError` (the package's root error) and output helpers.
- `render`        — compiler output: diagnostics in text, JSON, SARIF or GitHub annotations.
- `logs`          — logging for long-running commands: UTC timestamps, text or JSON lines.
- `proxy_worker`  — one worker process of `egresslaw proxy --workers N`.
- `__main__`      — `python -m egresslaw`.
"""

__version__ = "0.2.0"
