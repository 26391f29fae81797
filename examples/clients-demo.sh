#!/usr/bin/env bash
# Real `pip install` and `npm install` through the egress proxy, configured only by `egresslaw sandbox-env`,
# then a brokered `git clone` of a private repository and an authenticated `curl` from a sandbox that holds no token.
#
#   make venv && examples/clients-demo.sh [WORKDIR]        (default WORKDIR: build/clients-demo)
#
# The public registries are local stand-ins served under their real names (tests/clients/standins.py):
# the proxy runs with test routing (`--resolve` answers public-looking addresses that are never dialled,
# `--connect-to` dials 127.0.0.1, `--upstream-ca` trusts the stand-ins' CA). Nothing leaves this machine.
# docs/walkthrough.md ("Real clients through the proxy") shows these very commands; a test keeps the two equal.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
PATH="$VENV/bin:$PATH"
W="${1:-build/clients-demo}"
rm -rf "$W" && mkdir -p "$W/sandbox/project" "$W/ci" && W="$(cd "$W" && pwd)"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT

step() { printf '\n== %s (%ss)\n' "$*" "$SECONDS"; }

step "compile and prove the demo policy; keys; a credential in custody"
egresslaw compile policies/demo -o "$W/egresslaw.json" >/dev/null
egresslaw keys init --proof-signing --dir "$W/prover" >/dev/null   # the deploy pipeline's signing pair
egresslaw prove "$W/egresslaw.json" -o "$W/proof.json" --sign "$W/prover/proof-signing.key" >/dev/null
egresslaw keys init --dir "$W/keys"
printf %s "ghp_DemoTokenNeverLeavesCustody0123456789" | egresslaw custody put --keys "$W/keys" --store "$W/custody.db" \
    --workspace acme --connection github --handle gh-prod
# github-read (brokered for trusted-ci): GitHub's git endpoint takes HTTP Basic, so custody holds base64("x-access-token:TOKEN")
TOKEN="ghp_DemoReadOnlyTokenNeverInTheSandbox0123"
CRED=$(printf 'x-access-token:%s' "$TOKEN" | base64 -w0)
printf %s "$CRED" | egresslaw custody put --keys "$W/keys" --store "$W/custody.db" \
    --workspace acme --connection github-read --handle gh-read
printf 'Basic %s' "$CRED" > "$W/git-auth"  # what the github.com stand-in requires of acme/private.git

step "the stand-ins for pypi.org, files.pythonhosted.org, registry.npmjs.org, github.com, api.github.com"
python -m tests.clients.standins "$W/standins" --git-auth "$W/git-auth" > "$W/standins.json" &
PIDS+=($!)
until [ -s "$W/standins.json" ]; do sleep 0.2; kill -0 "${PIDS[-1]}" || exit 1; done
ROUTING=$(python -c '
import json, sys
s = json.load(open(sys.argv[1]))
print(" ".join([f"--resolve {r}" for r in s["resolve"]] + [f"--connect-to {c}" for c in s["connect_to"]] + ["--upstream-ca " + s["ca"]]))
' "$W/standins.json")

step "the proxy (test routing: warned at start-up, recorded in every audit event)"
# Two of the demo policy's six connections are sealed above: --allow-missing-credentials starts anyway (each missing
# address is warned; its requests would be denied credential-unavailable). Without it the proxy refuses to start.
export EGRESSLAW_WORKERS=1  # one process is plenty here, and its audit log is the one file shown below
# shellcheck disable=SC2086  # ROUTING is a list of options
egresslaw proxy --artifact "$W/egresslaw.json" --proof "$W/proof.json" --trust-proofs "$W/prover/proof-signing.pub" \
    --keys "$W/keys" --store "$W/custody.db" --listen 127.0.0.1:0 --admin 127.0.0.1:0 --confdir "$W/conf" \
    --audit-log "$W/audit.jsonl" --allow-missing-credentials $ROUTING 2> "$W/proxy.log" &
PIDS+=($!)
PROXY_PID=$!
until grep -q "listening on" "$W/proxy.log"; do sleep 0.2; kill -0 "${PIDS[-1]}" || { cat "$W/proxy.log"; exit 1; }; done
PROXY=$(sed -n 's/.*listening on \([0-9.]*:[0-9]*\).*/\1/p' "$W/proxy.log")
echo "proxy at $PROXY"

step "sandbox-env: the environment of a sandbox under profile package-builder (trusted side)"
egresslaw sandbox-env --proxy "$PROXY" --keys "$W/keys" --profile package-builder --subject demo-sandbox \
    --artifact "$W/egresslaw.json" --confdir "$W/conf" --bundle "$W/sandbox/ca-bundle.pem" > "$W/sandbox/env.sh"
sed -E 's/(egresslaw:el2\.[^.]+\.)[^@]+@/\1…@/' "$W/sandbox/env.sh"

step "inside the sandbox: nothing but that environment, then unchanged pip and npm"
env -i PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" HOME="$W/sandbox" bash -euc '
. "$HOME/env.sh"
pip install --disable-pip-version-check --target "$HOME/site" egresslaw-demo
cd "$HOME/project" && echo "{}" > package.json
npm install @acme/el-demo-scoped
'

step "brokering: a sandbox under profile trusted-ci clones a private repository and calls the API, holding no token"
egresslaw sandbox-env --proxy "$PROXY" --keys "$W/keys" --profile trusted-ci --subject demo-ci \
    --artifact "$W/egresslaw.json" --confdir "$W/conf" --bundle "$W/ci/ca-bundle.pem" > "$W/ci/env.sh"
env -i PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" HOME="$W/ci" bash -euc '
. "$HOME/env.sh"
git clone https://github.com/acme/private.git "$HOME/private" && cat "$HOME/private/README.md"
curl -sS https://api.github.com/repos/acme/app && echo
'
if grep -rqF -e "$TOKEN" -e "$CRED" "$W/ci"; then echo "the token is in the sandbox" >&2; exit 1; fi
echo "the sandbox holds no token: not in its environment, files or .git/config"

step "what the proxy decided (audit log)"
python - "$W/audit.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e.get("kind") in ("connect", "request"):
        via = f'  brokered by {e["broker"]} ({e["rule"]})' if e.get("broker") else ""
        print(f'{e["kind"]:8} {e["decision"]:5} {e["reason"]:16} {e.get("subject") or "-":13} {e["host"]}:{e["port"]} {e.get("path") or ""}{via}')
EOF
kill -TERM "$PROXY_PID" && wait "$PROXY_PID"  # drain, then close the log with a signed checkpoint
egresslaw audit verify "$W/audit.jsonl" --keys "$W/keys"
