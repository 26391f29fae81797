"""`egresslaw sandbox-run [options] -- CMD ARGS…`: run CMD where the egress proxy is the only way out.

    egresslaw sandbox-run --proxy 127.0.0.1:8080 --lease-file lease.txt --ca ca.pem -- npm ci
    EGRESSLAW_PROXY=127.0.0.1:8080 egresslaw sandbox-run -- node build.js

CMD runs in a fresh network namespace that holds nothing but `lo`: no other interface, no route, no DNS
server. Inside it, 127.0.0.1:3128 (`--inside-port`) listens, and every connection made to it is relayed,
byte for byte, to the one proxy address outside (`--proxy`). A client that ignores HTTPS_PROXY (Node 20's
`fetch`, a raw socket, a DNS query) finds no route instead of the internet. docs/isolation.md has the
design, the manual equivalent (`ip netns` + nftables) and what this does not guarantee.

How (one process becomes two, linked by a socketpair):

  parent (host namespace)                      child
  ──────────────────────                       ─────
  block the forwarded signals, fork ─────────▶ unshare(CLONE_NEWNET), or CLONE_NEWUSER|CLONE_NEWNET with
                                               a one-uid map when that is refused (not root); bring `lo` up;
                                               listen on 127.0.0.1:PORT
  receive the listener  ◀── SCM_RIGHTS ─────── send its fd, close it
  "go" ──────────────────────────────────────▶ execvpe(CMD) (the socketpair is close-on-exec: EOF = it ran)
  relay: accept on the namespace's listener    CMD: its environment says the proxy is 127.0.0.1:PORT
  (sockets keep the namespace they were made
  in), connect to the proxy, copy bytes;
  forward SIGTERM/SIGINT/…; CMD exits: stop
  the relay, exit with CMD's code

The relay never reads what it copies: it has one destination, resolved once at start, so no byte from
the sandbox can choose another. What a peer can make it hold is bounded: `--max-connections` relayed
connections (one more is reset at once), and one 64 KiB read per direction and connection (the next read
waits until that one is written).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket

from egress_proxy.front.settings import DEFAULTS
from egresslaw.common import CliError, err

INSIDE_PORT = 3128
MAX_CONNECTIONS = 256
CHUNK = 64 * 1024  # the most one direction of one connection holds in the relay
CONNECT_TIMEOUT = 10.0  # seconds for the relay (and the start-up check) to reach the proxy
WARN_INTERVAL = 5.0  # seconds between two warnings of one kind on stderr
# Signals sent to egresslaw that CMD receives instead (SIGKILL and SIGSTOP cannot be caught; SIGCHLD is ours).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
SI_KERNEL = 0x80  # si_code of a signal the kernel sent (a terminal's ^C, ^\, hang-up)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PR_SET_PDEATHSIG = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    from egresslaw.commands.lease import add_mint_arguments

    parser = subparsers.add_parser(
        "sandbox-run",
        help="run a command in an empty network namespace whose only way out is the egress proxy",
        description="run CMD in a fresh network namespace with nothing but `lo` (no route, no DNS server); inside it "
        f"127.0.0.1:{INSIDE_PORT} is relayed to the egress proxy outside, and CMD's environment (as `egresslaw "
        "sandbox-env` gives it: without proxy or EGRESSLAW_* variables, plus HTTPS_PROXY, HTTP_PROXY and ALL_PROXY in both "
        "cases, npm's and cargo's proxy settings, and with --ca/--confdir every client's CA variable) points every client "
        "there; clients that ignore that environment find no route (docs/isolation.md)",
        usage="egresslaw sandbox-run [options] -- CMD [ARGS…]",
    )
    parser.add_argument("--proxy", metavar="HOST:PORT",
                        help=f"the egress proxy, as this host reaches it (default: EGRESSLAW_PROXY, else {DEFAULTS.listen}); "
                        "a name is resolved once, at start")
    parser.add_argument("--inside-port", type=_port, default=INSIDE_PORT, metavar="PORT",
                        help=f"the port on 127.0.0.1 inside the namespace that leads to the proxy (default {INSIDE_PORT})")
    parser.add_argument("--max-connections", type=_positive, default=MAX_CONNECTIONS, metavar="N",
                        help=f"connections relayed at once; one more is reset at once (default {MAX_CONNECTIONS})")
    parser.add_argument("--lease-file", metavar="FILE", help="put this lease in CMD's proxy URLs (`-`: stdin); or mint one with --keys")
    mint = parser.add_argument_group("mint the lease here (trusted side) instead of --lease-file")
    add_mint_arguments(mint, required=False)
    ca = parser.add_mutually_exclusive_group()
    ca.add_argument("--ca", metavar="FILE", help="the proxy's CA certificate (PEM): CMD's clients trust it through one bundle")
    ca.add_argument("--confdir", metavar="DIR", help="the proxy's confdir: use (and create if needed) its CA, like `egresslaw ca`")
    parser.add_argument("--bundle", metavar="FILE", help="write the CA bundle (system roots + the proxy CA) here (default: a "
                        "temporary file, removed when CMD ends); wget's wgetrc is written beside it")
    parser.add_argument("--system-roots", metavar="FILE", help="the trusted roots to include (default: the system store, else certifi)")
    parser.add_argument("--no-proxy", default="", metavar="LIST", help="NO_PROXY inside (default empty: every name goes to the proxy)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS…", help="the command and its arguments")
    parser.set_defaults(run=run)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"`{text}` is not a port (1-65535)")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"`{text}` is not a positive integer")
    return int(text)


# ---------------------------------------------------------------------------------------------
# What CMD is given: its argv, its environment, the one proxy address
# ---------------------------------------------------------------------------------------------


def split_address(address: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `http://host:port` as (host, port); a CliError otherwise."""
    text = address.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c in text for c in "@/ "):
        raise CliError(f"--proxy `{address}` is not HOST:PORT", help="for example `--proxy 127.0.0.1:8080` or `--proxy [fd00::2]:8080`")
    return host, int(port)


def resolve_proxy(address: str) -> tuple[int, tuple]:
    """The proxy's one socket address (family, sockaddr): resolved here, once; the relay dials nothing else."""
    host, port = split_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise CliError(f"the proxy `{address}` does not resolve ({getattr(exc, 'strerror', None) or exc.__class__.__name__})",
                       help="give its address as HOST:PORT (--proxy or EGRESSLAW_PROXY)") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def check_reachable(address: str, family: int, sockaddr: tuple) -> None:
    """A CliError unless a TCP connection to the proxy opens: CMD never runs against a proxy that is down."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT)
        try:
            probe.connect(sockaddr)
        except OSError as exc:
            raise CliError(f"the proxy `{address}` is not reachable ({_reason(exc)}); nothing was run",
                           help="start it (`egresslaw proxy`), or point --proxy or EGRESSLAW_PROXY at it") from None


def find_command(argv: list[str], env: dict[str, str]) -> None:
    """A CliError unless argv[0] names an executable file (looked up in CMD's own PATH, as execvpe will)."""
    import shutil

    name = argv[0]
    if "/" in name:
        found = name if os.path.isfile(name) and os.access(name, os.X_OK) else None
        if os.path.isfile(name) and not found:
            raise CliError(f"command `{name}` is not executable", help="check its permissions")
    else:
        found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise CliError(f"command `{name}` not found", help="check its name, or give its path (it is looked up in PATH)")


def lease_of(args: argparse.Namespace) -> str | None:
    """The lease CMD's proxy URLs carry (read, or minted here), or None: the proxy then asks for one (407)."""
    from egresslaw.commands.sandbox_env import read_lease

    if args.lease_file and (args.keys or args.profile or args.connection):
        raise CliError("give either --lease-file or --keys with --profile/--connection, not both")
    if args.lease_file:
        if args.artifact:
            raise CliError("--artifact checks a lease minted here (with --keys)",
                           help="check a lease file when it is minted: `egresslaw lease --artifact A …`")
        lease = read_lease(args.lease_file)
        refuse_expired(lease, args.lease_file)
        return lease
    if args.keys or args.profile or args.connection:
        if not (args.keys and (args.profile or args.connection)):
            raise CliError("minting a lease needs --keys KEYS and --profile P or --connection C")
        from egresslaw.commands.lease import mint_from_args

        return mint_from_args(args)
    return None


def refuse_expired(lease: str, path: str) -> None:
    """A CliError when the lease read from `path` has expired: CMD would run and meet nothing but 407 lease-expired.

    A lease file is somebody else's (minted on the trusted side, maybe by another host), so it is never re-minted here:
    this command may hold no keys. The claims are read unverified (the proxy verifies the signature), and only `exp`
    decides; the lease itself is never shown."""
    import time

    from egresslaw.commands.lease import DEFAULT_ARTIFACT
    from egresslaw.commands.sandbox_env import lease_claims

    exp = lease_claims(lease).get("exp")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise CliError(f"the lease in {_shown_file(path)} has no expiry time; nothing was run",
                       help="mint a new one with `egresslaw lease --keys KEYS --profile P` (or --connection C)")
    if exp <= time.time():
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(exp))
        raise CliError(f"the lease in {_shown_file(path)} expired at {when}; nothing was run (the proxy would answer every "
                       "request 407 lease-expired)",
                       help=f"mint a new one with `egresslaw lease --keys KEYS --profile P --artifact {DEFAULT_ARTIFACT}` "
                       "(--ttl sets how long it lasts), or let sandbox-run mint it: `--keys KEYS --profile P` instead of "
                       "--lease-file")


def _shown_file(path: str) -> str:
    return "stdin" if path == "-" else f"`{path}`"


def environment_for(args: argparse.Namespace, lease: str | None, bundle: str | None) -> dict[str, str]:
    """CMD's environment: ours without proxy or EGRESSLAW_* variables, plus sandbox-env's, aimed at the inside listener."""
    from egresslaw.commands.sandbox_env import (
        CA_VARIABLES,
        environment,
        proxy_url,
        wgetrc_path,
    )

    inside = f"127.0.0.1:{args.inside_port}"
    url = proxy_url(inside, lease) if lease else f"http://{inside}"
    added = environment(url, bundle or "", args.no_proxy, wgetrc=wgetrc_path(bundle) if bundle else None)
    if bundle is None:
        added = {k: v for k, v in added.items() if k not in CA_VARIABLES}
    added.update(ALL_PROXY=url, all_proxy=url)
    kept = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and not k.startswith("EGRESSLAW_")}
    return {**kept, **added}


def write_ca_bundle(args: argparse.Namespace, scratch: list[str]) -> str | None:
    """With --ca/--confdir: write the bundle (system roots + proxy CA) and wget's wgetrc beside it, and return the
    bundle's absolute path (the same inside: only the network is CMD's own); else None."""
    from pathlib import Path

    from egresslaw.commands.sandbox_env import (
        proxy_ca,
        system_roots,
        wgetrc_path,
        write_bundle,
        write_wgetrc,
    )

    if not (args.ca or args.confdir):
        return None
    _, certs = proxy_ca(args)
    _, roots = system_roots(args.system_roots)
    target = args.bundle
    if target is None:
        import tempfile

        scratch.append(tempfile.mkdtemp(prefix="egresslaw-sandbox-"))
        target = os.path.join(scratch[-1], "ca-bundle.pem")
    write_bundle(target, roots, certs)
    bundle = str(Path(target).resolve())
    write_wgetrc(wgetrc_path(bundle), bundle)
    return bundle


def run(args: argparse.Namespace) -> int:
    import shutil

    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise CliError("no command given", help="egresslaw sandbox-run [options] -- CMD [ARGS…]")
    if any(c in (args.no_proxy or "") for c in "\r\n\0"):
        raise CliError("--no-proxy must be one line of host names")
    address = args.proxy or os.environ.get("EGRESSLAW_PROXY") or DEFAULTS.listen
    family, sockaddr = resolve_proxy(address)
    lease = lease_of(args)
    scratch: list[str] = []
    try:
        bundle = write_ca_bundle(args, scratch)
        env = environment_for(args, lease, bundle)
        find_command(argv, env)
        check_reachable(address, family, sockaddr)
        return Sandbox(argv, env, (family, sockaddr), address, args.inside_port, args.max_connections).run()
    finally:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The namespace (the child, until it becomes CMD) and the relay (the parent)
# ---------------------------------------------------------------------------------------------


class Sandbox:
    """CMD in a fresh network namespace; this process, outside it, relays the namespace's one listener to the proxy."""

    def __init__(self, argv: list[str], env: dict[str, str], target: tuple[int, tuple], shown: str,
                 inside_port: int, max_connections: int) -> None:
        self.argv, self.env, self.target, self.shown = argv, env, target, shown
        self.inside_port, self.max_connections = inside_port, max_connections

    def run(self) -> int:
        """Start CMD in its namespace, relay until it exits; its exit code (128+N when signal N ended it)."""
        ours, theirs = socket.socketpair()
        # Blocked before the fork, so a signal can neither kill us before we forward it nor reach the child's Python.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        try:
            pid = os.fork()
            if pid == 0:  # pragma: no cover (the child: it execs CMD or exits)
                ours.close()
                _child(theirs, self.argv, self.env, self.inside_port, mask)
            theirs.close()
            pidfd = os.pidfd_open(pid)
            try:
                listener = self._start(ours, pid)
                forwarder = _Forwarder(pidfd, pid)
                try:
                    import asyncio

                    asyncio.run(_supervise(listener, pidfd, Relay(self.target, self.shown, self.max_connections)))
                except BaseException:
                    _kill(pid)  # the relay failed: CMD is left with no way out, and must not outlive it
                    raise
                finally:
                    forwarder.stop()
                    listener.close()
                return _exit_code(os.waitpid(pid, 0)[1])
            finally:
                os.close(pidfd)
        finally:
            ours.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _start(self, ours: socket.socket, pid: int) -> socket.socket:
        """The listener the child made inside the namespace, once CMD has been exec'd; a CliError if either failed."""
        ours.settimeout(60)
        try:
            message, fds, _, _ = socket.recv_fds(ours, 512, 1)
            if message.startswith(b"ok") and len(fds) == 1:
                listener = socket.socket(fileno=fds[0])
                ours.sendall(b"g")
                message = ours.recv(512)  # EOF: the socketpair closed on exec, CMD runs
                if not message:
                    listener.setblocking(False)
                    return listener
                listener.close()
            else:
                for fd in fds:
                    os.close(fd)
        except OSError:  # the child is stuck or gone
            message = b""
        _kill(pid)
        raise _failure(message, self.argv[0], self.inside_port)


def _failure(message: bytes, command: str, port: int) -> CliError:
    """What the child reported (`STAGE ERRNO`) as the error to show."""
    import errno

    stage, number, kind = (message.decode("ascii", "replace").split(" ") + ["", "", ""])[:3]
    code = int(number) if number.isdigit() else 0
    reason = os.strerror(code).lower() if code else (kind or "no reason given")
    if stage == "unshare":
        return CliError(f"cannot create a network namespace ({reason})",
                        help="run as root, or allow user namespaces (sysctl user.max_user_namespaces > 0, "
                        "kernel.unprivileged_userns_clone=1, no AppArmor/SELinux rule against them)")
    if stage == "map":
        return CliError(f"cannot map this user into the new user namespace ({reason})", help="run as root")
    if stage == "listen":
        return CliError(f"cannot listen on 127.0.0.1:{port} inside the namespace ({reason})", help="choose another --inside-port")
    if stage == "exec":
        if code in (errno.ENOENT, errno.ENOTDIR):
            return CliError(f"command `{command}` not found", help="check its name, or give its path (it is looked up in PATH)")
        return CliError(f"cannot run `{command}` ({reason})", help="check that it is an executable file")
    return CliError(f"the sandbox did not start ({stage or 'the child exited'}: {reason})")


def _kill(pid: int) -> None:
    """Kill and reap the child (unreaped until here, its pid cannot have been reused)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _child(sock: socket.socket, argv: list[str], env: dict[str, str], port: int, mask) -> None:  # pragma: no cover
    """The forked child: make the namespace, hand over its listener, exec CMD. Never returns."""
    stage = "setup"
    try:
        # Everything the child runs is imported before unshare: in a user namespace the files of the interpreter
        # may no longer be readable (they were, say, through a capability that holds only outside it).
        import array  # noqa: F401 (socket.send_fds imports it)
        import ctypes
        import fcntl
        import struct

        parent = os.getppid()
        _die_with(ctypes, parent)
        stage = "unshare"
        userns = _unshare()
        if userns:
            stage = "map"
            _map_ids()
        stage = "loopback"
        _loopback_up(fcntl, struct)
        stage = "listen"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(128)
        socket.send_fds(sock, [b"ok"], [listener.fileno()])
        listener.close()  # CMD must not hold it: every connection to it goes through the relay
        if sock.recv(1) != b"g":
            os._exit(1)
        stage = "exec"
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; an ignored signal stays ignored across exec
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.execvpe(argv[0], argv, env)
    except BaseException as exc:  # noqa: BLE001 (the child must never return into egresslaw: it reports, then exits)
        number = (exc.errno or 0) if isinstance(exc, OSError) else 0
        try:
            sock.sendall(f"{stage} {number} {exc.__class__.__name__}".encode())
        except OSError:
            pass
    os._exit(127)


def _die_with(ctypes, parent: int) -> None:  # pragma: no cover (the child)
    """Be killed if egresslaw dies (its relay gone, CMD would sit in a namespace with no way out, orphaned)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _unshare() -> bool:  # pragma: no cover (the child)
    """A new network namespace; True if a user namespace had to be made too (not root, or no CAP_SYS_ADMIN)."""
    try:
        os.unshare(os.CLONE_NEWNET)
        return False
    except PermissionError:
        os.unshare(os.CLONE_NEWUSER | os.CLONE_NEWNET)
        return True


def _map_ids() -> None:  # pragma: no cover (the child)
    """Map our own uid and gid to themselves: CMD keeps its identity, and (being no uid 0) execs without capabilities."""
    uid, gid = os.geteuid(), os.getegid()
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1\n"), ("gid_map", f"{gid} {gid} 1\n")):
        fd = os.open(f"/proc/self/{name}", os.O_WRONLY)
        try:
            os.write(fd, text.encode())  # INVARIANT: one write(2), as the kernel requires for these files
        finally:
            os.close(fd)


def _loopback_up(fcntl, struct) -> None:  # pragma: no cover (the child)
    """`ip link set lo up`, as one ioctl: the namespace's only interface, and the only one it gets."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


class _Forwarder:
    """Forwards the blocked FORWARDED signals to CMD (by pidfd: never to a recycled pid), from a thread of its own.

    A signal the terminal sent (^C) reached CMD already (it is in our process group): it is not sent twice."""

    def __init__(self, pidfd: int, pid: int) -> None:
        import threading

        self.pidfd, self.pid, self.stopping = pidfd, pid, False
        self.thread = threading.Thread(target=self._loop, name="egresslaw-signals", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            info = signal.sigwaitinfo(FORWARDED)
            if self.stopping:
                return
            if info.si_code == SI_KERNEL and info.si_signo in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP) and self._same_group():
                continue
            try:
                signal.pidfd_send_signal(self.pidfd, info.si_signo)
            except OSError:  # CMD has exited already
                pass

    def _same_group(self) -> bool:
        try:
            return os.getpgid(self.pid) == os.getpgrp()
        except OSError:
            return False

    def stop(self) -> None:
        self.stopping = True
        signal.pthread_kill(self.thread.ident, FORWARDED[0])
        self.thread.join(5)


async def _supervise(listener: socket.socket, pidfd: int, relay: Relay) -> None:
    """Relay until CMD exits (its pidfd turns readable), then stop: the namespace's listener dies with the relay."""
    import asyncio

    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
    serving = loop.create_task(relay.serve(listener))
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        serving.cancel()
        await relay.close(serving)


class Relay:
    """Copies each connection accepted on the listener to a new connection to the proxy, and back; nothing else."""

    def __init__(self, target: tuple[int, tuple], shown: str, max_connections: int) -> None:
        self.family, self.sockaddr = target  # INVARIANT: the only address this class ever connects to
        self.shown, self.max_connections = shown, max_connections
        self.active: set = set()
        self._warned: dict[str, tuple[float, int]] = {}

    async def serve(self, listener: socket.socket) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        while True:
            try:
                client, _ = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, say: the kernel's backlog holds the next ones
                self.warn("accept", f"cannot accept a connection ({_reason(exc)})")
                await asyncio.sleep(0.1)
                continue
            if len(self.active) >= self.max_connections:
                self.warn("limit", f"{self.max_connections} connections are relayed already (--max-connections); "
                          "a new one was reset")
                _reset(client)
                continue
            task = loop.create_task(self._connection(client))
            self.active.add(task)
            task.add_done_callback(self.active.discard)

    async def close(self, serving) -> None:
        import asyncio

        for task in [serving, *self.active]:
            task.cancel()
        await asyncio.gather(serving, *self.active, return_exceptions=True)

    async def _connection(self, client: socket.socket) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        upstream = socket.socket(self.family, socket.SOCK_STREAM)
        upstream.setblocking(False)
        clean = False
        tasks: list = []
        try:
            try:
                await asyncio.wait_for(loop.sock_connect(upstream, self.sockaddr), CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                self.warn("proxy", f"the proxy `{self.shown}` is not reachable ({_reason(exc)}); a connection from the sandbox was reset")
                return
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            tasks = [loop.create_task(_copy(client, upstream)), loop.create_task(_copy(upstream, client))]
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not all(t.result() for t in done):
                    break  # a reset or an error on one side: the other side is reset too
            else:
                clean = True
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            for sock in (client, upstream):
                sock.close() if clean else _reset(sock)

    def warn(self, kind: str, message: str) -> None:
        """`warning: …` on stderr, at most once every WARN_INTERVAL seconds per kind (a count says how many were held back)."""
        import time

        now = time.monotonic()
        last, held = self._warned.get(kind, (float("-inf"), 0))
        if now - last < WARN_INTERVAL:
            self._warned[kind] = (last, held + 1)
            return
        self._warned[kind] = (now, 0)
        more = f" ({held} more like it)" if held else ""
        err(f"egresslaw sandbox-run: warning: {message}{more}")


async def _copy(src: socket.socket, dst: socket.socket) -> bool:
    """src to dst until src's EOF (passed on as a half-close): True; False on an error on either side."""
    import asyncio

    loop = asyncio.get_running_loop()
    try:
        while data := await loop.sock_recv(src, CHUNK):
            await loop.sock_sendall(dst, data)  # INVARIANT: the next read waits until this chunk is written
        dst.shutdown(socket.SHUT_WR)
        return True
    except OSError:
        return False


def _reason(exc: OSError) -> str:
    """`connection refused`, `timed out`: the error without the address asyncio adds to its message."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    return os.strerror(exc.errno).lower() if exc.errno else exc.__class__.__name__


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the peer learns at once that nothing is behind it."""
    import struct

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
