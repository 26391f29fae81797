"""The sandbox side of the real-client tests: a proxy enforcing a policy in front of the stand-ins, and clients run
with nothing but `egresslaw sandbox-env`'s output (tests/clients/test_real_clients.py, tests/clients/test_yarn.py).

One in-process proxy at a time: mitmproxy keeps its options in a process-wide context (`mitmproxy.ctx`), and with a
second in-process proxy started, the first refused its own valid leases as `lease-key-unknown`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

from compiler.compile import compile_paths
from egress_proxy.custody.secret import encodings_of
from tests.clients import standins as si
from tests.proxy_harness import (
    CANARY,
    Pki,
    ScriptedResolver,
    assert_no_canary,
    free_port,
    make_env,
    proof_signing_key,
    seal,
    start_proxy,
    stop_proxy,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
EGRESSLAW = str(Path(sys.executable).with_name("egresslaw"))
DEMO_CATALOG = "2026.11"  # what policies/demo pins
# github-read's custody secret: GitHub's git endpoint takes HTTP Basic, `x-access-token:TOKEN` (the canary as TOKEN).
BROKERED = base64.b64encode(f"x-access-token:{CANARY}".encode()).decode()
BROKERED_AUTH = f"Basic {BROKERED}"


def demo_artifact(root: Path, catalog: str = DEMO_CATALOG):
    """policies/demo compiled as shipped, or copied under `root` with its one `catalog` line moved to `catalog`."""
    policy = ROOT / "policies" / "demo"
    if catalog != DEMO_CATALOG:
        policy = root / "policy"
        shutil.copytree(ROOT / "policies" / "demo", policy, ignore=shutil.ignore_patterns("egresslaw.lock"))
        workers = policy / "workers.egress"
        text = workers.read_text()
        assert text.count(f'catalog "{DEMO_CATALOG}"') == 1, f"policies/demo no longer pins {DEMO_CATALOG}: adjust DEMO_CATALOG"
        workers.write_text(text.replace(f'catalog "{DEMO_CATALOG}"', f'catalog "{catalog}"'))
    result = compile_paths([policy])
    assert result.artifact is not None and result.artifact.catalog.version == catalog, result.diagnostics
    return result.artifact


def serve(root: Path, services: si.StandIns, artifact) -> World:
    """Keys, custody (github-read's credential sealed) and a proxy enforcing `artifact` in front of `services`."""
    env = make_env(root / "edge", artifact=artifact)  # seals the canary as `github`'s credential
    seal(env.store, env.keys, "github-read", "gh-read", BROKERED.encode())  # workspace `acme`, as policies/demo
    # the proxy refuses to start while a connection has no credential; these tests call no other connection
    for c in artifact.connections:
        if c.name not in ("github", "github-read"):
            seal(env.store, env.keys, c.name, c.credential_handle, b"placeholder, never sent by these tests")
    pki = Pki(services.ca_pem, services.ca_pem, services.ca_pem, services.ca_pem)  # only the CA is read: --upstream-ca
    resolver = ScriptedResolver({name: [[ip]] for name, ip in si.PUBLIC.items()})
    return World(root, services, env, start_proxy(env, pki, (), services.connect_to(), resolver=resolver))


@contextlib.contextmanager
def lane_beside_edge(tmp_path: Path, policy: str):
    """`policy` compiled, its stand-ins, the edge serving it (`serve`) and the real Envoy lane beside it on one CA and
    one artifact; yields (world, lane, loop, port, audit); stops the lane, then closes the world (its leak checks)."""
    from egress_proxy.run.lane import Lane, LaneConfig  # Imported here: an import cost (only the lane's tests start one)

    root = tmp_path / "policy"
    root.mkdir()
    (root / "builder.egress").write_text(policy)
    result = compile_paths([root])
    assert result.artifact is not None, [d.message for d in result.diagnostics]
    services = si.start(tmp_path / "standins")
    world = serve(tmp_path / "edge", services, result.artifact)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    env, audit, port = world.env, tmp_path / "lane-audit.jsonl", free_port()
    lane = Lane(LaneConfig(artifact=str(env.artifact), proof=str(env.proof), keys=str(env.keys), audit_log=str(audit),
                           listen=("127.0.0.1", port), admin=None, confdir=str(env.confdir), run_dir=str(tmp_path / "lane"),
                           trust_proofs=str(proof_signing_key()[1]), connect_to=tuple(services.connect_to()),
                           upstream_ca=str(services.ca_pem)),
                resolver=ScriptedResolver({name: [[ip]] for name, ip in si.PUBLIC.items()}))
    asyncio.run_coroutine_threadsafe(lane.start(), loop).result(60)
    try:
        yield SimpleNamespace(world=world, lane=lane, loop=loop, port=port, audit=audit)
    finally:
        asyncio.run_coroutine_threadsafe(lane.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        close(world)
        services.stop()


def close(world: World) -> None:
    """Stop the proxy, then check that nothing secret reached its logs, its audit log or any client."""
    proxy = world.proxy
    stop_proxy(proxy)
    proxy.assert_nothing_leaked()
    text = proxy.logs.text() + proxy.audit_bytes().decode()
    assert not any(t in text for t in world.leases), "a lease is in the proxy's logs or audit log"
    for shown in [*proxy.seen, text.encode()]:
        assert_no_secret(shown, "a client-visible response, the proxy's logs or the audit log")



class World:
    def __init__(self, root: Path, services: si.StandIns, env, proxy) -> None:
        self.root, self.services, self.env, self.proxy = root, services, env, proxy
        self.leases: list[str] = []
        self._n = 0

    def sandbox_env(self, *which: str, fmt: str = "json") -> tuple[dict[str, str] | str, Path]:
        """Run `egresslaw sandbox-env` (minting the lease with --keys) and return its output and the sandbox's HOME."""
        self._n += 1
        home = self.root / f"sandbox-{self._n}"
        home.mkdir()
        cmd = [EGRESSLAW, "sandbox-env", "--proxy", f"{self.proxy.host}:{self.proxy.port}", "--keys", str(self.env.keys),
               "--artifact", str(self.env.artifact), "--subject", f"sandbox-{self._n}", *which,
               "--ca", str(self.proxy.ca), "--bundle", str(home / "ca-bundle.pem"), "--format", fmt]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""  # the lease is printed on stdout, the one place it must be, and nowhere else
        if fmt == "json":
            env = json.loads(done.stdout)["env"]
            self.leases.append(env["HTTPS_PROXY"].split(":", 2)[2].split("@")[0])
            return env, home
        return done.stdout, home

    def run(self, cmd: list[str], env: dict[str, str], home: Path, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """A client in a subprocess whose environment is PATH, HOME, LANG and the sandbox environment only."""
        done = subprocess.run(cmd, env=self._env(env, home), cwd=cwd or home, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, start_new_session=True)
        self.proxy.record(done.stdout + done.stderr)
        return done

    def run_on_a_terminal(self, cmd: list[str], env: dict[str, str], home: Path, cwd: Path, *, kill_when=None,
                          timeout: float = 120) -> tuple[int, bytes, bool]:
        """`run`, with a pseudo-terminal as the client's stdin, stdout and stderr (some clients act differently on one).

        With `kill_when`, the client's process group is killed as soon as that predicate holds (or at `timeout`).
        Returns (exit status, what the terminal showed, whether `kill_when` held)."""
        import pty

        master, slave = pty.openpty()
        proc = subprocess.Popen(cmd, env=self._env(env, home), cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                                start_new_session=True)
        os.close(slave)
        shown: list[bytes] = []

        def drain() -> None:  # a full pty buffer would block the client
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the last writer closed the terminal
                    return
                if not data:
                    return
                shown.append(data)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        held = False
        try:
            if kill_when is not None:
                held = wait_for(kill_when, timeout=timeout)
                os.killpg(proc.pid, signal.SIGKILL)
            status = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            reader.join(timeout=10)
            os.close(master)
        self.proxy.record(b"".join(shown))
        return status, b"".join(shown), held

    @staticmethod
    def _env(env: dict[str, str], home: Path) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8", **env}

    def events(self, subject: str) -> list[dict]:
        """The subject's decision events, each with its outcome (status, bytes, redactions) folded in."""
        return [e for e in self.proxy.settled((0, [])) if e.get("subject") == subject]


def assert_no_secret(data: bytes | str, where: str) -> None:
    """Neither the canary token nor the brokered Basic credential built from it, in any encoding the scan knows."""
    assert_no_canary(data, where)
    blob = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    for needle in encodings_of(BROKERED.encode()):
        assert needle not in blob, f"the brokered credential is in {where}"


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, (done.stdout.decode(errors="replace")[-2000:], done.stderr.decode(errors="replace")[-3000:])
    return done.stdout.decode()


def allowed_hosts(world: World, subject: str) -> set[str]:
    events = world.events(subject)
    assert events and all(e["decision"] == "allow" for e in events), [(e["host"], e["reason"]) for e in events if e["decision"] != "allow"]
    return {e["host"] for e in events}

