"""One module per CLI command family. Each defines `register(subparsers)` and sets `run=` on its parser.

Modules are discovered by name, so adding a command never touches `cli.py`. Import heavy
dependencies (z3, mitmproxy, lark) inside the run function, not at module level.
"""
