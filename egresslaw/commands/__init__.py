"""One module per CLI command family. Each defines `register(subparsers)` and sets `run=` on its parser.

Modules are discovered by name, so adding a command never touches `cli.py`. `egresslaw` builds its
parser from every command module, so each one imports the project (and z3, mitmproxy, lark) inside
its run function: a command pays only for what it runs. That is the one reason for every
function-local import below `egresslaw/commands/` (tests/test_layout.py holds the rest of the tree
to a comment per such import).
"""
