"""One module per CLI command family. Each defines `register(subparsers)` and sets `run=` on its parser.

- `check`, `compile`, `fmt`, `show`, `import_cma` — policies: admit, build the artifact, format, show, import.
- `prove`, `diff`, `explain` — before deploy: the proofs, the semantic diff, one request through the decision.
- `proxy`, `lane`, `ca` — running: the mitmproxy edge, the Envoy lane, the proxy CA's path.
- `keys`, `custody`, `lease` — the trusted side: keys, sealed credentials, lease tokens.
- `sandbox_env`, `sandbox_run` — sandboxes: the environment clients need, a command whose one way out is the proxy.
- `audit`, `propose` — afterwards: verify the audit chains, grow a policy from its denials.

Modules are discovered by name, so adding a command never touches `cli.py`. `egresslaw` builds its
parser from every command module, so each one imports the project (and z3, mitmproxy, lark) inside
its run function: a command pays only for what it runs. That is the one reason for every
function-local import below `egresslaw/commands/` (tests/test_layout.py holds the rest of the tree
to a comment per such import).
"""
