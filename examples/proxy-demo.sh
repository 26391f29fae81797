#!/usr/bin/env bash
# The walk-through's section 3 ("Run the egress proxy", docs/walkthrough.md), run verbatim on this machine, with nothing leaving it.
#
#   make venv && examples/proxy-demo.sh [WORKDIR]        (default WORKDIR: build/proxy-demo)
#
# In WORKDIR: sections 1-2's commands that section 3 needs (compile, the prover's signing pair, a signed proof), then
# the stand-ins of tests/clients/standins.py (api.github.com is a TLS echo of the Authorization it received), then
# Section 3's block, read from docs/walkthrough.md and run as it stands (in WORKDIR, as the walk-through runs it in
# its scratch directory build/walkthrough), with three things in its environment only:
# GITHUB_TOKEN (a demo token), HOME (so ~/.egresslaw is WORKDIR/home/.egresslaw) and test routing as EGRESSLAW_*
# variables the proxy reads like its flags (--resolve answers public-looking addresses that are never dialled,
# --connect-to dials the stand-in on 127.0.0.1, --upstream-ca trusts the stand-in's CA).
# PROXY_DEMO_LISTEN / PROXY_DEMO_ADMIN replace 127.0.0.1:8080 / 127.0.0.1:9090 when those ports are taken.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PATH="$VENV/bin:$PATH"
W="${1:-$ROOT/build/proxy-demo}"
rm -rf "$W" && mkdir -p "$W/home" && W="$(cd "$W" && pwd)"
cp -r "$ROOT/policies" "$W/policies"
cd "$W"
STANDINS=
# Section 3 sends the proxy's log to proxy.log; the demo shows it on stderr at the end, whatever happened.
trap '[ -n "$STANDINS" ] && kill "$STANDINS" 2>/dev/null; wait 2>/dev/null; [ ! -f "$W/proxy.log" ] || cat "$W/proxy.log" >&2; true' EXIT

step() { printf '\n== %s\n' "$*"; }

step "sections 1-2: compile, the prover's signing pair, a signed proof"
egresslaw compile policies/demo -o build/egresslaw.json >/dev/null
egresslaw keys init --proof-signing --dir PROVER_KEYS >/dev/null
egresslaw prove build/egresslaw.json -o build/proof.json --jobs 2 --sign PROVER_KEYS/proof-signing.key | tail -1

step "a local TLS stand-in for api.github.com (test routing)"
(cd "$ROOT" && exec python -m tests.clients.standins "$W/standins") > "$W/standins.json" &
STANDINS=$!
until [ -s "$W/standins.json" ]; do sleep 0.2; kill -0 "$STANDINS" || exit 1; done
eval "$(python - "$W/standins.json" <<'PY'
import json, shlex, sys
s = json.load(open(sys.argv[1]))
for name, value in (("EGRESSLAW_RESOLVE", " ".join(s["resolve"])), ("EGRESSLAW_CONNECT_TO", " ".join(s["connect_to"])),
                    ("EGRESSLAW_UPSTREAM_CA", s["ca"])):
    print(f"export {name}={shlex.quote(value)}")
PY
)"

step "walk-through section 3, as written"
python - "$ROOT/docs/walkthrough.md" "${PROXY_DEMO_LISTEN:-}" "${PROXY_DEMO_ADMIN:-}" > "$W/section3.sh" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
section = text[text.index("### 3. Run the egress proxy"):text.index("### 4.")]
(block,) = re.findall(r"```sh\n(.*?)```", section, re.S)
for default, given in (("127.0.0.1:8080", sys.argv[2]), ("127.0.0.1:9090", sys.argv[3])):
    if given:
        block = block.replace(default, given)
print(block)
PY
sed 's/^/  | /' "$W/section3.sh"
echo
GITHUB_TOKEN="ghp_ProxyDemoTokenStaysInCustody0123456789" HOME="$W/home" bash -euo pipefail "$W/section3.sh"
