"""The properties, stated independently of the code they judge.

- `addresses`  — `public-only` and `deny-cidrs`, from the RFCs and the catalog's special-purpose table.
- `requests`   — `credential-scope` and `header-safety`, from the artifact as declared and SPEC section 2.1.
- `switches`   — `worker-switches`, from the worker's settings as declared (SPEC section 3).
- `shapes`     — `shape-confined`, from the rule's request shapes as declared (docs/shapes.md).
- `resolution` — `dns-confined`, from the rules and allowlists as declared (the names a front end may resolve).

Each module states its property from its source as Z3 formulas over the prover's symbolic inputs. Nothing
here imports `egress_proxy` (a test checks it): a bug planted in the decision core cannot move
the specification with it.
"""
