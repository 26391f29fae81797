"""`egresslaw sandbox-env`: the environment a sandbox needs to reach the egress proxy with unchanged clients.

    egresslaw sandbox-env --proxy 10.0.0.2:8080 --lease-file lease.txt --confdir ~/.egresslaw --bundle /srv/sb/ca.pem
    egresslaw sandbox-env --proxy 10.0.0.2:8080 --keys KEYS --profile ci-builder --subject sb-7 --ca ca.pem \\
        --bundle out/ca.pem --bundle-path /etc/egresslaw/ca.pem --format json

Prints proxy URLs carrying the lease (`http://egresslaw:<lease>@proxy:port`: every client library turns that
into `Proxy-Authorization: Basic`), the CA variables of each client family pointing at one CA bundle (the
system roots plus the proxy's CA), npm, yarn and cargo settings, and apt's proxy/CA lines. Beside the bundle
it writes a wgetrc (`<bundle>.wgetrc`, exported as `WGETRC`): wget reads none of the CA variables. The lease
appears in the printed environment because the sandbox needs it; it appears nowhere else (no log line, no
error message, not in the bundle or the wgetrc). The traps that no variable can fix are in docs/clients.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from egresslaw.common import CliError, out, read_text

USER = "egresslaw"  # the proxy URL's user name: ignored by the proxy (the lease is the password)
NO_PROXY = "localhost,127.0.0.1,::1"
FORMATS = ("export", "dotenv", "json", "apt")
_LEASE = re.compile(r"^el2\.lk-[0-9a-f]{16}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$")
_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+?-----END CERTIFICATE-----")
# Variables that name the one CA file, by the client that reads them.
CA_VARIABLES = (
    "SSL_CERT_FILE",  # OpenSSL's default (python urllib/ssl, httpx, Go, Ruby, uv)
    "REQUESTS_CA_BUNDLE",  # python requests
    "CURL_CA_BUNDLE",  # curl
    "PIP_CERT",  # pip
    "NODE_EXTRA_CA_CERTS",  # node: added to its built-in roots
    "npm_config_cafile",  # npm: replaces Node's roots, and outranks any npmrc `cafile`/`ca`
    "GIT_SSL_CAINFO",  # git over https (libcurl)
    "CARGO_HTTP_CAINFO",  # cargo
)
WGETRC_SUFFIX = ".wgetrc"  # the wgetrc is `<bundle>.wgetrc`: never `~/.wgetrc`, which wget would read without WGETRC


def register(subparsers: argparse._SubParsersAction) -> None:
    from egresslaw.commands.lease import add_mint_arguments

    parser = subparsers.add_parser(
        "sandbox-env",
        help="print the environment a sandbox needs to use the proxy (proxy URLs with the lease, CA bundle, npm, cargo, wget, apt)",
        description="print the environment variables (and apt lines) that make unchanged clients (curl, pip, npm, yarn, git, "
        "python, node, cargo, wget, apt) use the egress proxy with a lease, and write the CA bundle they need (and, "
        "beside it, the wgetrc that makes wget trust it)",
    )
    parser.add_argument("--proxy", required=True, metavar="HOST:PORT", help="the proxy's address as the sandbox reaches it")
    parser.add_argument("--lane", metavar="HOST:PORT", help="the Envoy lane's address (`egresslaw lane`): the sandbox gets it instead "
                        "of --proxy when the lease's profile is one the lane serves (brokers nothing, enforced, host names only); "
                        "needs --artifact, which says which profiles those are")
    parser.add_argument("--lease-file", metavar="FILE", help="read the lease from FILE (`-`: stdin); or mint one with --keys")
    mint = parser.add_argument_group("mint the lease here (trusted side) instead of --lease-file")
    add_mint_arguments(mint, required=False)
    ca = parser.add_mutually_exclusive_group(required=True)
    ca.add_argument("--ca", metavar="FILE", help="the proxy's CA certificate (PEM), e.g. the path `egresslaw ca` prints")
    ca.add_argument("--confdir", metavar="DIR", help="the proxy's confdir: use (and create if needed) its CA, like `egresslaw ca`")
    parser.add_argument("--bundle", required=True, metavar="FILE",
                        help=f"write the CA bundle (system roots + the proxy CA) here, and wget's settings to FILE{WGETRC_SUFFIX}")
    parser.add_argument("--bundle-path", metavar="PATH", help="the bundle's path inside the sandbox (default: --bundle, made absolute)")
    parser.add_argument("--system-roots", metavar="FILE", help="the trusted roots to include (default: the system store, else certifi)")
    parser.add_argument("--no-proxy", default=NO_PROXY, metavar="LIST", help=f"NO_PROXY for the sandbox (default {NO_PROXY})")
    parser.add_argument("--format", choices=FORMATS, default="export", help="export lines (default), a .env file, JSON, or apt.conf lines")
    parser.set_defaults(run=run)


def proxy_url(address: str, lease: str) -> str:
    """`http://egresslaw:<lease>@host:port` from `host:port`, `[v6]:port` or `http://host:port`."""
    text = address.strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or "@" in text or "/" in text:
        raise CliError(f"--proxy `{address}` is not HOST:PORT", help="for example `--proxy 10.0.0.2:8080` or `--proxy [fd00::2]:8080`")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{USER}:{lease}@{host}:{int(port)}"


def environment(url: str, bundle: str, no_proxy: str, *, wgetrc: str | None = None) -> dict[str, str]:
    """Every variable a sandbox needs: proxies (both cases: curl reads only lowercase `http_proxy`), CA paths, npm, cargo,
    yarn; `WGETRC` only with `wgetrc`, the sandbox path of the file `write_wgetrc` wrote (a WGETRC that names a missing
    file makes wget refuse to start)."""
    env = {
        "HTTPS_PROXY": url,
        "https_proxy": url,
        "HTTP_PROXY": url,
        "http_proxy": url,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
        "npm_config_https_proxy": url,
        "npm_config_proxy": url,
        "CARGO_HTTP_PROXY": url,
        "NODE_USE_ENV_PROXY": "1",  # Node >= 24 (and 22.21): fetch and http honour HTTPS_PROXY; older Nodes ignore it
        # yarn 1 on a terminal asks https://yarnpkg.com/latest-version on every run (it records the check only when it
        # succeeds); that is no package host, so the proxy refuses it and yarn retries for ~12 s after its work is done
        "YARN_DISABLE_SELF_UPDATE_CHECK": "true",
    }
    env.update({name: bundle for name in CA_VARIABLES})
    if wgetrc is not None:
        env["WGETRC"] = wgetrc
    return env


def wgetrc_path(bundle: str) -> str:
    """The wgetrc that goes with `bundle` (a host or a sandbox path): beside it, `<bundle>.wgetrc`."""
    return bundle + WGETRC_SUFFIX


def wgetrc(bundle: str) -> str:
    """wgetrc lines that make wget trust `bundle`; the proxy (and its lease) come from `https_proxy`, not from a file."""
    # INVARIANT: no lease here; the file sits beside the bundle on the host, where the lease must not be written.
    # `use_proxy = on` is wget's default, restated because this file is read after /etc/wgetrc and wins over it.
    return ("# egresslaw sandbox-env: wget reads none of the CA variables, so WGETRC names this file\n"
            f"ca_certificate = {bundle}\nuse_proxy = on\n")


def apt_conf(url: str, bundle: str) -> str:
    """apt.conf lines (e.g. /etc/apt/apt.conf.d/90egresslaw): the proxy for http and https, and the CA for https."""
    return f'Acquire::http::Proxy "{url}/";\nAcquire::https::Proxy "{url}/";\nAcquire::https::CAInfo "{bundle}";\n'


def read_lease(path: str) -> str:
    """The lease from a file or stdin; an error never quotes the file's content."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="ascii")
    except FileNotFoundError:
        raise CliError(f"lease file `{path}` does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read lease file `{path}`: {exc.__class__.__name__}") from None
    token = text.strip()
    if not _LEASE.match(token):
        raise CliError(f"lease file `{path}` does not hold one lease token", help="mint one with `egresslaw lease` (leases minted before key ids must be minted again)")
    return token


def proxy_ca(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The proxy CA's path and its certificates; a file that also holds a private key is refused, never copied."""
    if args.confdir:
        from egresslaw.commands.ca import ca_certificate

        path = str(ca_certificate(args.confdir))
    else:
        path = args.ca
    text = read_text(path, "proxy CA")
    if "PRIVATE KEY-----" in text:
        raise CliError(f"proxy CA `{path}` holds a private key; it must never reach a sandbox",
                       help="give the certificate alone: the path `egresslaw ca --confdir DIR` prints (mitmproxy-ca-cert.pem)")
    certs = _PEM_CERT.findall(text)
    if not certs:
        raise CliError(f"proxy CA `{path}` holds no PEM certificate")
    from cryptography import x509

    for pem in certs:
        try:
            cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
            ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except (ValueError, x509.ExtensionNotFound):
            ca = False
        if not ca:
            raise CliError(f"proxy CA `{path}` holds a certificate that is not a CA", help="give the proxy's CA certificate, as `egresslaw ca` prints it")
    return path, certs


def system_roots(path: str | None) -> tuple[str, str]:
    """The trusted roots to put first in the bundle: `--system-roots`, the system store, or certifi's."""
    if path is None:
        import ssl

        paths = ssl.get_default_verify_paths()
        path = next((p for p in (paths.cafile, paths.openssl_cafile) if p and Path(p).is_file()), None)
        if path is None:
            import certifi

            path = certifi.where()
    text = read_text(path, "system roots")
    if not _PEM_CERT.search(text) or "PRIVATE KEY-----" in text:
        raise CliError(f"system roots `{path}` is not a PEM bundle of certificates")
    return path, text


def write_bundle(target: str, roots: str, certs: list[str]) -> None:
    """System roots then the proxy CA, in one PEM file (0644: certificates only), written atomically."""
    _write_public(target, roots.rstrip("\n") + "\n\n# egresslaw proxy CA\n" + "\n".join(certs) + "\n", "the CA bundle")


def write_wgetrc(target: str, bundle: str) -> None:
    """The wgetrc naming `bundle` (its path inside the sandbox) at `target` (0644: no secret), written atomically."""
    _write_public(target, wgetrc(bundle), "the wgetrc")


def _write_public(target: str, text: str, what: str) -> None:
    """`text` into `target` with mode 0644, by a rename: a reader sees the old file or the new one, never half."""
    import os
    import tempfile

    dest = Path(target)
    tmp = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise CliError(f"cannot write {what} `{target}`: {exc.strerror or exc.__class__.__name__}") from None


def render(fmt: str, env: dict[str, str], apt: str, bundle: str, header: str) -> str:
    """The environment in one format; JSON also names the files the sandbox must see (`ca_bundle`, `wgetrc`)."""
    if fmt == "json":
        doc = {"env": env, "apt_conf": apt, "ca_bundle": bundle}
        if "WGETRC" in env:
            doc["wgetrc"] = env["WGETRC"]
        return json.dumps(doc, indent=2, sort_keys=True)
    if fmt == "apt":
        return apt.rstrip("\n")
    if fmt == "dotenv":  # no quoting: `docker run --env-file` takes every character after `=` literally
        return "\n".join([f"# {header}", *(f"{k}={v}" for k, v in env.items())])
    return "\n".join([f"# {header}", *(f"export {k}={shlex.quote(v)}" for k, v in env.items())])


def lease_claims(token: str) -> dict:
    """The lease's claims, unverified (the proxy verifies it): for the header comment and the --artifact check."""
    import base64

    try:
        claims = json.loads(base64.urlsafe_b64decode(token.split(".")[2] + "=="))
    except (ValueError, IndexError):
        claims = None
    if not isinstance(claims, dict) or not (isinstance(claims.get("profile"), str) or isinstance(claims.get("connection"), str)):
        raise CliError("the lease's claims are malformed", help="mint a new one with `egresslaw lease`")
    return claims


def describe(token: str) -> str:
    """A comment naming what the lease grants and until when."""
    import time

    try:
        claims = lease_claims(token)
        what = f"profile `{claims['profile']}`" if "profile" in claims else f"connection `{claims['connection']}`"
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(claims["exp"])))
        return f"egresslaw sandbox environment: {what}, subject `{claims['sub']}`, lease expires {until}"
    except (CliError, ValueError, KeyError, TypeError, OverflowError):
        return "egresslaw sandbox environment"


def lane_for(args: argparse.Namespace, lease: str) -> str:
    """The one address the sandbox gets: the Envoy lane's when it serves the lease's profile, else the proxy's."""
    if not args.lane:
        return args.proxy
    if not args.artifact:
        raise CliError("--lane needs --artifact: which profiles the lane serves is read from the artifact")
    from compiler.artifact import ArtifactError, load_artifact
    from egress_proxy.lane.envoy import served

    try:
        artifact = load_artifact(Path(args.artifact).read_bytes())
    except (OSError, ArtifactError) as exc:
        raise CliError(f"cannot read artifact `{args.artifact}`: {exc}") from None
    profile = lease_claims(lease).get("profile")
    return args.lane if isinstance(profile, str) and profile in served(artifact).names() else args.proxy


def run(args: argparse.Namespace) -> int:
    if args.lease_file and (args.keys or args.profile or args.connection):
        raise CliError("give either --lease-file or --keys with --profile/--connection, not both")
    if args.lease_file:
        lease = read_lease(args.lease_file)
        if args.artifact:
            from egresslaw.commands.lease import check_subject

            claims = lease_claims(lease)
            check_subject(args.artifact, profile=claims.get("profile"), connection=claims.get("connection"))
    elif args.keys and (args.profile or args.connection):
        from egresslaw.commands.lease import mint_from_args

        lease = mint_from_args(args)
    else:
        raise CliError("no lease: give --lease-file FILE, or --keys KEYS with --profile P or --connection C",
                       help="the lease is minted on the trusted side (`egresslaw lease`)")
    if any(c in (args.no_proxy or "") for c in "\r\n\"'"):
        raise CliError("--no-proxy must be one line of host names, without quotes")
    url = proxy_url(lane_for(args, lease), lease)
    _, certs = proxy_ca(args)
    _, roots = system_roots(args.system_roots)
    inside = args.bundle_path or str(Path(args.bundle).resolve())  # a relative path would break in any other directory
    if any(c in inside for c in "\r\n\"'"):
        raise CliError("--bundle-path must be a plain path, without quotes or line breaks")
    write_bundle(args.bundle, roots, certs)
    write_wgetrc(wgetrc_path(args.bundle), inside)  # the sandbox sees it beside the bundle, as `wgetrc_path(inside)`
    env = environment(url, inside, args.no_proxy, wgetrc=wgetrc_path(inside))
    out(render(args.format, env, apt_conf(url, inside), inside, describe(lease)))
    return 0

