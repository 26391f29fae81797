# egresslaw egress proxy: the runtime only, as an unprivileged user (uid 10001). No z3 (the proxy never imports it:
# prove where `pip install 'egresslaw[prove]'` is), no pip, no test dependencies, no build tools. docs/container.md
# says why each step is there; tests/deploy/test_image_build.py runs these lines (without docker) against this file.
# From the repository root, with a policy in build/policy-src (docs/container.md has one to try) and the token to
# seal in GITHUB_TOKEN:
#
#   # 1. where the `prove` extra is installed: compile, prove and sign; the image gets the three files of build/policy
#   egresslaw keys init --proof-signing --dir build/signing   # once; build/signing/proof-signing.key stays here
#   egresslaw compile build/policy-src -o build/policy/egresslaw.json
#   egresslaw prove build/policy/egresslaw.json -o build/policy/proof.json --sign build/signing/proof-signing.key
#   cp build/signing/proof-signing.pub build/policy/
#   # 2. the image
#   docker build -t egresslaw:local .
#   # 3. keys made inside the image as uid 10001, in a named volume: a new volume takes the owner and mode of the
#   #    image's /etc/egresslaw/keys (10001, 0700), and `keys init` writes the keys as 10001, mode 0600
#   docker run --rm --user 10001:10001 -v egresslaw-keys:/etc/egresslaw/keys egresslaw:local keys init
#   # 4. the credential sealed into the custody store on the data volume (the secret on stdin, never in arguments);
#   #    the artifact fills in workspace and handle, and refuses a connection it does not have
#   printf '%s\n' "$GITHUB_TOKEN" | docker run --rm -i --user 10001:10001 \
#       -v egresslaw-keys:/etc/egresslaw/keys:ro -v egresslaw-data:/var/lib/egresslaw \
#       -v "$PWD/build/policy:/etc/egresslaw/policy:ro" egresslaw:local custody put --connection github
#   # 5. the proxy: sandboxes on 8080, the admin port (/metrics, /healthz, /readyz) on the host's loopback only
#   docker run -d --name egresslaw --read-only --tmpfs /tmp \
#       -v "$PWD/build/policy:/etc/egresslaw/policy:ro" -v egresslaw-keys:/etc/egresslaw/keys:ro \
#       -v egresslaw-data:/var/lib/egresslaw -p 8080:8080 -p 127.0.0.1:9090:9090 egresslaw:local
#   # 6. a lease for a sandbox (the proxy password its clients send; `sandbox-env` prints everything a sandbox needs)
#   docker run --rm -v egresslaw-keys:/etc/egresslaw/keys:ro -v "$PWD/build/policy:/etc/egresslaw/policy:ro" \
#       egresslaw:local lease --connection github --subject agent-1
#   # 7. the stop: SIGTERM drains (up to EGRESSLAW_DRAIN_GRACE, 10 s) and closes the audit chains, which verify
#   docker stop -t 30 egresslaw
#   docker run --rm -v egresslaw-keys:/etc/egresslaw/keys:ro -v egresslaw-data:/var/lib/egresslaw \
#       egresslaw:local audit verify /var/lib/egresslaw/audit --keys /etc/egresslaw/keys
#
# Configuration is EGRESSLAW_* environment variables, read by every command (each is also a flag of `egresslaw
# proxy`); nothing secret is baked in: keys, the custody store and the CA come from volumes at run time.
# The base is pinned to a patch release; in production also pin its digest (`python:…@sha256:…`).

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# The runtime dependencies first, each file checked against the lock's sha256 (the runtime part of
# requirements.lock, made by `make lock`); --no-deps: nothing outside the lock is installed. Its own layer: rebuilt only when the lock changes.
COPY deploy/requirements-proxy.lock ./deploy/
RUN python -m venv /opt/egresslaw \
 && /opt/egresslaw/bin/pip install --require-hashes --no-deps -r deploy/requirements-proxy.lock
COPY pyproject.toml README.md LICENSE ./
COPY catalog ./catalog
COPY compiler ./compiler
COPY proofs ./proofs
COPY egress_proxy ./egress_proxy
COPY egresslaw ./egresslaw
# egresslaw itself as a wheel, --no-deps (its requirements are the lock's); `pip check` proves the lock covers them;
# then pip goes (nothing at run time installs anything, and an attacker in the container gets no installer).
RUN /opt/egresslaw/bin/pip wheel --no-deps --wheel-dir /tmp/dist . \
 && /opt/egresslaw/bin/pip install --no-deps /tmp/dist/egresslaw-*.whl \
 && /opt/egresslaw/bin/pip check \
 && /opt/egresslaw/bin/pip uninstall -y pip setuptools wheel

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="egresslaw" \
      org.opencontainers.image.description="egress proxy that enforces proved egress policy" \
      org.opencontainers.image.licenses="Apache-2.0"
# /etc/egresslaw/keys is 10001's and 0700 so that a named volume mounted there starts out so (`keys init` as 10001).
RUN groupadd --system --gid 10001 egresslaw \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin egresslaw \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/egresslaw /var/lib/egresslaw/conf /var/lib/egresslaw/audit /var/lib/egresslaw/custody \
 && install -d -m 0755 /etc/egresslaw /etc/egresslaw/policy \
 && install -d -o 10001 -g 10001 -m 0700 /etc/egresslaw/keys
COPY --from=build /opt/egresslaw /opt/egresslaw
ENV PATH=/opt/egresslaw/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    EGRESSLAW_ARTIFACT=/etc/egresslaw/policy/egresslaw.json \
    EGRESSLAW_PROOF=/etc/egresslaw/policy/proof.json \
    EGRESSLAW_TRUST_PROOFS=/etc/egresslaw/policy/proof-signing.pub \
    EGRESSLAW_KEYS=/etc/egresslaw/keys \
    EGRESSLAW_STORE=/var/lib/egresslaw/custody/custody.db \
    EGRESSLAW_CONFDIR=/var/lib/egresslaw/conf \
    EGRESSLAW_AUDIT_LOG=/var/lib/egresslaw/audit/audit.jsonl \
    EGRESSLAW_LISTEN=0.0.0.0:8080 \
    EGRESSLAW_ADMIN=0.0.0.0:9090 \
    EGRESSLAW_LOG_FORMAT=json
USER 10001:10001
WORKDIR /var/lib/egresslaw
VOLUME ["/var/lib/egresslaw"]
EXPOSE 8080 9090
# /healthz on the admin port needs no token (egress_proxy/run/metrics.py); the venv's python asks, since a slim image
# has no curl. Any failure (refused, timeout, non-200) exits 1: unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["/opt/egresslaw/bin/python", "-c", "import os, sys, urllib.request; port = os.environ.get('EGRESSLAW_ADMIN', ':9090').rpartition(':')[2]; sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4).status == 200 else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["egresslaw"]
CMD ["proxy"]
