# egresslaw egress proxy: the runtime only (no test dependencies, no build tools), as an unprivileged user.
#
#   docker build -t egresslaw:0.1.0 .
#   docker run --read-only -v ./policy:/etc/egresslaw/policy:ro -v ./keys:/etc/egresslaw/keys:ro \
#              -v egresslaw-data:/var/lib/egresslaw -p 8080:8080 -p 9090:9090 egresslaw:0.1.0
#
# Configuration is EGRESSLAW_* environment variables (each is also a `egresslaw proxy` flag); nothing
# secret is baked in: keys, the custody store and the CA come from mounts at run time.
# The base is pinned to a patch release; in production also pin its digest (`python:…@sha256:…`).

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY catalog ./catalog
COPY compiler ./compiler
COPY proofs ./proofs
COPY egress_proxy ./egress_proxy
COPY egresslaw ./egresslaw
# One install of the runtime dependencies only (no `[test]` extra), then a consistency check.
RUN python -m venv /opt/egresslaw \
 && /opt/egresslaw/bin/pip install . \
 && /opt/egresslaw/bin/pip check

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="egresslaw" \
      org.opencontainers.image.description="egress proxy that enforces proved egress policy" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 egresslaw \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin egresslaw \
 && install -d -o 10001 -g 10001 -m 0700 /var/lib/egresslaw /var/lib/egresslaw/conf /var/lib/egresslaw/audit /var/lib/egresslaw/custody \
 && install -d -m 0755 /etc/egresslaw /etc/egresslaw/policy
COPY --from=build /opt/egresslaw /opt/egresslaw
ENV PATH=/opt/egresslaw/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    EGRESSLAW_ARTIFACT=/etc/egresslaw/policy/egresslaw.json \
    EGRESSLAW_PROOF=/etc/egresslaw/policy/proof.json \
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
STOPSIGNAL SIGTERM
ENTRYPOINT ["egresslaw"]
CMD ["proxy"]
