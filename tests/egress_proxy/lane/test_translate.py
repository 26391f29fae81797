"""The translation check reads the configuration back, as generated and as Envoy loaded it, and refuses anything
beyond the allowlists.

Each mutation below is one way a generator bug (or a hand edit) could widen what Envoy admits; the check must name
it. The unmutated configuration must pass. The expected side is the artifact's reach (`egress_proxy.lane.reach`):
the check must still name every mutation with every function of the generator replaced by one that fails, and a
generator whose own idea of a profile's reach is wrong (it adds `host:443` where the allowlist says `host:80`) is
refused by the check, by `lane --check-only` and at start-up. On the real Envoy, what Envoy loaded (its admin
`/config_dump`) is checked at start and at every reload: a written file that differs from the checked documents
stops the start, and refuses a reload with the configuration last loaded exactly written back."""

from __future__ import annotations

import ast
import asyncio
import copy
import inspect
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from egress_proxy.front.ca import ca_certificate
from egress_proxy.lane import envoy, translate
from egress_proxy.lane.certs import write_leaves
from tests.egress_proxy import builders as b
from tests.egress_proxy.lane.test_envoy import layout
from tests.proxy_harness import ROOT, ScriptedResolver, free_port, make_env, proof_for, proof_signing_key


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("translate")
    art = b.artifact(profiles=[b.profile("ci", [("pypi.org", 443), ("deb.debian.org", 80)]), b.profile("docs", [("pypi.org", 443)])])
    lay = layout(tmp)
    write_leaves(ca_certificate(tmp / "conf").with_name("mitmproxy-ca.pem"), envoy.hosts_needing_certificates(art), lay.cert_dir)
    return art, lay


def _docs(setup):
    art, lay = setup
    return art, lay, envoy.generate(art, lay)


def test_the_generated_configuration_is_exact(setup):
    art, lay, docs = _docs(setup)
    assert translate.check(art, docs, lay) == []


def _front_routes(docs):
    return docs["rds"]["resources"][0]["virtual_hosts"][0]["routes"]


def _cluster(docs, name):
    return next(c for c in docs["cds"]["resources"] if c["name"] == name)


def _listener(docs, name):
    return next(x for x in docs["lds"]["resources"] if x["name"] == name)


def _inner_filters(docs, name="mitm|ci|pypi.org:443"):
    return _listener(docs, name)["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]


MUTATIONS = {
    "a route for another host": lambda d: _front_routes(d).insert(0, copy.deepcopy(_front_routes(d)[0]) | {"match": {
        "connect_matcher": {}, "headers": [{"name": envoy.LANE_HEADER, "string_match": {"exact": "ci"}},
                                           {"name": envoy.AUTHORITY_HEADER, "string_match": {"exact": "evil.example:443"}}]}}),
    "a route matching by prefix regex": lambda d: _front_routes(d)[0]["match"]["headers"][1].update(string_match={"prefix": "pypi"}),
    "a route without the profile": lambda d: _front_routes(d)[0]["match"].update(headers=_front_routes(d)[0]["match"]["headers"][1:]),
    "the lease left in": lambda d: _front_routes(d)[1]["request_headers_to_remove"].remove("proxy-authorization"),
    "a cluster dialling another port": lambda d: _cluster(d, "tls|ci|pypi.org:443")["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"].update(port_value=8443),
    "upstream TLS without the name check": lambda d: _cluster(d, "tls|ci|pypi.org:443")["transport_socket"]["typed_config"][
        "common_tls_context"]["validation_context"].pop("match_typed_subject_alt_names"),
    "a resolver beside the DNS front": lambda d: _cluster(d, "http|ci|deb.debian.org:80")["typed_dns_resolver_config"]["typed_config"].update(
        use_resolvers_as_fallback=True),
    "a tunnel taking any SNI": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0].pop("filter_chain_match"),
    "a tunnel admitting any Host": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["domains"].append("*"),
    "a refusal answering 200": lambda d: _front_routes(d)[-1]["direct_response"].update(status=200),
    "a certificate for another name": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["transport_socket"][
        "typed_config"]["common_tls_context"]["tls_certificates"][0]["certificate_chain"].update(
        filename=_listener(d, "mitm|ci|deb.debian.org:80")["filter_chains"][0]["transport_socket"]["typed_config"][
            "common_tls_context"]["tls_certificates"][0]["certificate_chain"]["filename"]),
    "no authorizer": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"].pop(0),
    "a lost route": lambda d: _front_routes(d).pop(0),
    "an early mutation setting Host in a tunnel": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["filters"][0][
        "typed_config"].update(early_header_mutation_extensions=[{"name": "x", "typed_config": {"@type": "type.googleapis.com/envoy."
                               "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation", "mutations": [
                                   {"append": {"header": {"key": "host", "value": "evil.test"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}]),
    # The filters every request inside a tunnel runs (the authorizer's check, the native strip), widened:
    "an inner strip that sets a header": lambda d: _inner_filters(d)[1]["typed_config"]["mutations"]["request_mutations"].append(
        {"append": {"header": {"key": "x-egresslaw-lane-profile", "value": "ci"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}),
    "an inner check that re-picks the route": lambda d: _inner_filters(d)[0]["typed_config"]["default_source_code"].update(
        inline_string=_inner_filters(d)[0]["typed_config"]["default_source_code"]["inline_string"].replace(
            "    return\n", '    h:headers():replace(":authority", "evil.test") h:clearRouteCache()\n    return\n', 1)),
    "an inner check that never asks the authorizer": lambda d: _inner_filters(d)[0]["typed_config"]["default_source_code"].update(
        inline_string="function envoy_on_request(h) end"),
    "no inner check": lambda d: _inner_filters(d).pop(0),
    "a front filter state that steers Envoy": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"][0]["typed_config"]["on_request_headers"][0].update(object_key="envoy.tcp_proxy.cluster"),
    # Not hashable, the id keys no connection pool: a tunnel may be handed another CONNECT's connection, and its id
    # (tests/egress_proxy/run/test_lane_tunnels_concurrent.py).
    "a tunnel id that does not key the connection pool": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0][
        "typed_config"]["http_filters"][0]["typed_config"]["on_request_headers"][0].update(factory_key="envoy.string"),
    "a tunnel cluster passing metadata": lambda d: _cluster(d, "mitm|ci|pypi.org:443")["transport_socket"]["typed_config"].update(
        passthrough_metadata=[{"kind": {"host": {}}, "name": "x"}]),
    "an early mutation on the front": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0]["typed_config"].update(
        early_header_mutation_extensions=[{"name": "x", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.http."
                                           "early_header_mutation.header_mutation.v3.HeaderMutation", "mutations": [
                                               {"append": {"header": {"key": "x-forwarded-proto", "value": "https"}}}]}}]),
    # The one early write allowed, the copy of `Transfer-Encoding` for the check, turned to another name or value:
    "the framing copy writing a routing header": lambda d: _framing(d, "front").update(key="x-egresslaw-lane-profile"),
    "the framing copy writing another value in a tunnel": lambda d: _framing(d, "mitm|ci|pypi.org:443").update(value="%REQ(host)%"),
    # HTTP/2 somewhere: a head that does not frame its body (no length, no Transfer-Encoding), so a bytes cap charges
    # nothing for it and a GET carries one (HEADERS without END_STREAM, then DATA).
    "a tunnel offering h2": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["transport_socket"]["typed_config"][
        "common_tls_context"].update(alpn_protocols=["h2", "http/1.1"]),
    "a tunnel whose codec may speak HTTP/2": lambda d: _listener(d, "mitm|ci|pypi.org:443")["filter_chains"][0]["filters"][0][
        "typed_config"].pop("codec_type"),
    "a front that may speak HTTP/2": lambda d: _listener(d, "front")["filter_chains"][0]["filters"][0]["typed_config"].update(
        codec_type="AUTO"),
}


def _framing(docs, listener: str) -> dict:
    """The header the listener's early mutation copies `Transfer-Encoding` into (`envoy._keep_framing`)."""
    ext = _listener(docs, listener)["filter_chains"][0]["filters"][0]["typed_config"]["early_header_mutation_extensions"][0]
    return next(m for m in ext["typed_config"]["mutations"] if "append" in m)["append"]["header"]


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_widening_is_named(setup, mutation):
    art, lay, docs = _docs(setup)
    MUTATIONS[mutation](docs)
    problems = translate.check(art, docs, lay)
    assert problems, f"the check missed: {mutation}"


# -- the expected side shares nothing with the generator ---------------------------------------------------------


def _fail(name):
    def failing(*args, **kwargs):
        raise AssertionError(f"the translation check called the generator's `{name}`")
    return failing


def _generator_functions():
    return [name for name, fn in inspect.getmembers(envoy, inspect.isfunction) if fn.__module__ == envoy.__name__]


def test_the_check_calls_no_function_of_the_generator(setup, monkeypatch):
    """Every function of `envoy.py` (its `served`, `authorities`, `name`, `generate`, ...) replaced by one that fails:
    the check still passes the exact configuration and still names every mutation."""
    art, lay, docs = _docs(setup)
    mutated = {}
    for mutation, mutate in MUTATIONS.items():
        mutated[mutation] = copy.deepcopy(docs)
        mutate(mutated[mutation])
    names = _generator_functions()
    assert {"served", "authorities", "name", "hosts_needing_certificates", "generate"} <= set(names)
    for name in names:
        monkeypatch.setattr(envoy, name, _fail(name))
    assert translate.check(art, docs, lay) == []
    missed = [m for m, d in mutated.items() if not translate.check(art, d, lay)]
    assert not missed, missed


def test_the_check_imports_only_wire_names_and_the_layout_from_the_generator():
    """What `translate.py` takes from `envoy.py` is data (the authorizer's header and cluster names, the runner's
    `Layout`), never a function; `reach.py` takes nothing (and an import contract in pyproject.toml says so too)."""
    for module, allowed in (("translate", {"Layout"}), ("reach", set())):
        tree = ast.parse((ROOT / "egress_proxy" / "lane" / f"{module}.py").read_text())
        taken = {a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "egress_proxy.lane.envoy"
                 for a in node.names}
        whole = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "egress_proxy.lane"
                 and any(a.name == "envoy" for a in node.names)]
        assert not whole, f"{module}.py imports the generator's module"
        assert all(name.isupper() or name in allowed for name in taken), (module, taken)
        if module == "reach":
            assert not taken


def _widened_authorities(real):
    """The issue's generator bug: `host:443` beside every `host:80` of a profile's allowlist."""
    def authorities(prof):
        pairs = real(prof)
        return tuple(sorted(set(pairs) | {(host, 443) for host, port in pairs if port == 80}))
    return authorities


def test_a_generator_that_widens_a_profile_by_its_own_reach_is_refused(setup, monkeypatch):
    art, lay = setup
    monkeypatch.setattr(envoy, "authorities", _widened_authorities(envoy.authorities))
    docs = envoy.generate(art, lay)
    assert any(c["name"] == "tls|ci|deb.debian.org:443" for c in docs["cds"]["resources"])  # the bug is planted
    problems = translate.check(art, docs, lay)
    assert "profile `ci` (connect): admits [('deb.debian.org', 443)] beyond its allowlist" in problems, problems
    assert "profile `ci` (https): admits [('deb.debian.org', 443)] beyond its allowlist" in problems, problems


def test_a_generator_that_serves_an_observed_profile_is_refused(tmp_path, monkeypatch):
    """The generator's `served` wrong (it takes an observe-mode profile): the routes it writes for it are refused."""
    art = b.artifact(profiles=[b.profile("ci", [("pypi.org", 443)]), b.profile("watch", [("pypi.org", 443)]).model_copy(update={"enforce": "observe"})])
    lay = layout(tmp_path)
    write_leaves(ca_certificate(tmp_path / "conf").with_name("mitmproxy-ca.pem"), ["pypi.org"], lay.cert_dir)
    real = envoy.served
    monkeypatch.setattr(envoy, "served", lambda a: envoy.Served(tuple(a.sandbox_profiles), {}) if a is art else real(a))
    problems = translate.check(art, envoy.generate(art, lay), lay)
    assert any("forwards without matching one served profile" in p for p in problems), problems


# -- `lane --check-only` and start-up, with the generator's bug planted ------------------------------------------

API, PKGS = "api.acme-test.dev", "pkgs.acme-test.dev"


def plant(kind: str) -> None:
    """A generator bug, planted in this process (the CLI tests run `egresslaw` in a child that calls this first)."""
    if kind == "widened":
        envoy.authorities = _widened_authorities(envoy.authorities)
    elif kind == "tampered-write":
        real = envoy.write
        envoy.write = lambda docs, run_dir: real(_wider_routes(docs), run_dir)
    else:
        raise ValueError(kind)


def _wider_routes(docs):
    """The documents as checked, with one route more in the written copy: profile `ci` reaching evil.example:443."""
    docs = copy.deepcopy(docs)
    routes = docs["rds"]["resources"][0]["virtual_hosts"][0]["routes"]
    extra = copy.deepcopy(routes[0])
    extra["match"]["headers"][1]["string_match"]["exact"] = "evil.example:443"
    routes.insert(0, extra)
    return docs


def _egresslaw(planted: str, *argv: str) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom tests.egress_proxy.lane.test_translate import plant\nplant(sys.argv[1])\n"
            "from egresslaw.cli import main\nsys.exit(main(sys.argv[2:]))")
    return subprocess.run([sys.executable, "-c", code, planted, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _lane_argv(env, tmp: Path, port: int) -> list[str]:
    return ["lane", "--artifact", str(env.artifact), "--proof", str(env.proof), "--trust-proofs", str(proof_signing_key()[1]),
            "--keys", str(env.keys), "--confdir", str(tmp / "conf"), "--run-dir", str(tmp / "run"), "--listen", f"127.0.0.1:{port}",
            "--admin", f"127.0.0.1:{free_port()}", "--audit-log", str(tmp / "lane-audit.jsonl"), "--nameserver", "127.0.0.1:9",
            "--dns-timeout", "1"]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_check_only_refuses_the_widened_generator(tmp_path):
    env = make_env(tmp_path / "env", b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80)])]))
    out = tmp_path / "envoy"
    done = _egresslaw("widened", *_lane_argv(env, tmp_path, free_port()), "--check-only", str(out))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"lane serves profile `ci`: {API}:443, {PKGS}:80" in done.stdout  # what the artifact allows, not the generator
    assert f"translation: profile `ci` (connect): admits [('{PKGS}', 443)] beyond its allowlist" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr


def _config(env, tmp: Path, port: int):
    from egress_proxy.run.lane import LaneConfig

    return LaneConfig(artifact=str(env.artifact), proof=str(env.proof), keys=str(env.keys), audit_log=str(tmp / "lane-audit.jsonl"),
                      listen=("127.0.0.1", port), admin=None, confdir=str(tmp / "conf"), run_dir=str(tmp / "run"),
                      trust_proofs=str(proof_signing_key()[1]), dns_timeout=1.0, drain_grace=1.0,
                      watch_interval=0)  # reloads only when the test asks


@pytest.mark.slow
def test_start_up_refuses_the_widened_generator_before_envoy_runs(tmp_path, monkeypatch):
    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.lane import Lane

    plant_widened = _widened_authorities(envoy.authorities)
    monkeypatch.setattr(envoy, "authorities", plant_widened)
    env = make_env(tmp_path / "env", b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80)])]))
    port = free_port()
    lane = Lane(_config(env, tmp_path, port), resolver=ScriptedResolver())
    with pytest.raises(StartupError, match=r"generated Envoy configuration does not admit exactly.*admits \[\('pkgs") as caught:
        asyncio.run(lane.start())
    assert caught.value.help and "--check-only" in caught.value.help
    assert lane.envoy is None and not (tmp_path / "run" / "xds" / "rds.json").exists()
    assert not _listening(port)


# -- what Envoy loaded, on the real Envoy binary ------------------------------------------------------------------


def _envoy_children() -> list[int]:
    """Envoy processes whose parent is this test process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"envoy" in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


@pytest.mark.slow
def test_a_written_file_that_differs_from_the_checked_documents_stops_the_start(tmp_path, monkeypatch):
    """The documents pass the check, the file Envoy reads has one route more: the check of Envoy's config dump refuses
    the start, and no Envoy is left running, nothing listens."""
    from egress_proxy.front.startup import StartupError
    from egress_proxy.run.lane import Lane, envoy_binary

    assert envoy_binary() is not None
    real = envoy.write
    monkeypatch.setattr(envoy, "write", lambda docs, run_dir: real(_wider_routes(docs), run_dir))
    env = make_env(tmp_path / "env", b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80)])]))
    port = free_port()
    lane = Lane(_config(env, tmp_path, port), resolver=ScriptedResolver())
    with pytest.raises(StartupError, match=r"configuration Envoy loaded does not admit exactly.*evil\.example") as caught:
        asyncio.run(lane.start())
    assert caught.value.help and "xds" in caught.value.help
    assert lane.envoy is not None and lane.envoy.returncode is not None  # it ran, and was stopped
    assert not _listening(port) and not _envoy_children()


@pytest.mark.slow
def test_the_cli_exits_2_with_error_and_help_when_envoy_loaded_something_else(tmp_path):
    env = make_env(tmp_path / "env", b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80)])]))
    port = free_port()
    done = _egresslaw("tampered-write", *_lane_argv(env, tmp_path, port))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: the configuration Envoy loaded does not admit exactly the allowlists" in done.stderr, done.stderr
    assert "evil.example" in done.stderr and "help: " in done.stderr and "Traceback" not in done.stderr
    assert not _listening(port)


@pytest.mark.slow
def test_what_envoy_loaded_is_checked_at_start_and_at_every_reload(tmp_path, monkeypatch, caplog):
    """A good start passes the config-dump check; a reload whose written files differ from its checked documents is
    refused (counted, logged), the configuration last loaded exactly is written back and Envoy serves it again; the
    same reload untampered goes through and the authorizer switches."""
    from egress_proxy.run.lane import Lane

    first = b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80)])])
    env = make_env(tmp_path / "env", first)
    lane = Lane(_config(env, tmp_path, free_port()), resolver=ScriptedResolver())
    armed = []
    real = envoy.write_one  # a reload writes the files one at a time (Lane._stage): the routes file is tampered
    monkeypatch.setattr(envoy, "write_one", lambda kind, doc, run_dir: real(
        kind, _wider_routes({"rds": doc})["rds"] if kind == "rds" and armed and armed.pop() else doc, run_dir))
    wider = b.artifact(profiles=[b.profile("ci", [(API, 443), (PKGS, 80), ("other.acme-test.dev", 443)])])

    async def scenario() -> None:
        await lane.start()
        try:
            assert lane.policy.artifact.digest == first.digest
            assert await translate.confirm_loaded(first, lane.layout) == []
            now = translate.loaded(await translate.config_dump(lane.layout.envoy_admin))
            assert now.versions == (first.digest, first.digest) and not now.warming and not now.rejected
            assert {x["name"] for x in now.docs["lds"]["resources"]} == {"front", f"mitm|ci|{API}:443", f"mitm|ci|{PKGS}:80"}

            env.proof.write_text(proof_for(wider))
            env.artifact.write_text(wider.to_json())
            armed.append(True)
            assert lane.reload() is True  # the gate and the check of the generated documents pass
            assert await asyncio.wait_for(lane.reloading, 120) is False
            assert lane.metrics.reloads.get("failed") == 1 and "ok" not in lane.metrics.reloads
            refusal = [r.getMessage() for r in caplog.records if r.getMessage().startswith("reload refused")]
            assert len(refusal) == 1 and "configuration Envoy loaded" in refusal[0] and "evil.example" in refusal[0], refusal
            assert lane.policy.artifact.digest == first.digest and lane.served == {"ci"}
            assert await translate.confirm_loaded(first, lane.layout) == []  # written back, and loaded exactly again

            assert lane.reload() is True
            assert await asyncio.wait_for(lane.reloading, 120) is True
            assert lane.metrics.reloads.get("ok") == 1 and lane.policy.artifact.digest == wider.digest
            assert await translate.confirm_loaded(wider, lane.layout) == []
            assert await translate.confirm_loaded(first, lane.layout, timeout=0) != []  # and judged against the new reach

            # A new digest that changes nothing the lane serves (an observed profile, left to the edge): Envoy's
            # configuration is the same but for its version, and the reload still goes through.
            same = b.artifact(profiles=[*wider.sandbox_profiles, b.profile("watch", [(API, 443)]).model_copy(update={"enforce": "observe"})])
            env.proof.write_text(proof_for(same))
            env.artifact.write_text(same.to_json())
            assert lane.reload() is True
            assert await asyncio.wait_for(lane.reloading, 120) is True
            assert lane.policy.artifact.digest == same.digest and lane.metrics.reloads.get("ok") == 2
        finally:
            await lane.stop()

    asyncio.run(scenario())
