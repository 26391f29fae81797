"""The properties, stated independently of the code they judge.

Each module here states one property from its source — the RFCs and the IANA-derived catalog
table for addresses, SPEC section 2.1 for the header denylist, the artifact *as declared* for
credential scope and trust lanes — as Z3 formulas over the prover's symbolic inputs. Nothing
here imports `egress_proxy` (a test checks it): a bug planted in the decision core cannot move
the specification with it.
"""
