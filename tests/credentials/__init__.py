"""Brokered-credential tests: independent provider stand-ins (providers.py) and the tests that drive them."""
