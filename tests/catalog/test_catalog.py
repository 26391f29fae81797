"""The catalog: published versions are immutable, and the special-purpose table is complete."""

from __future__ import annotations

import ipaddress
import json
import shutil

import pytest

import catalog.model as catalog_model
from catalog import ECOSYSTEMS, available_versions, load_catalog, verify_manifest

CAT = load_catalog("2026.11")
VERSIONS = available_versions()


def test_published_catalog_matches_its_manifest():
    assert verify_manifest() == []


def test_an_edited_published_file_is_detected(tmp_path, monkeypatch):
    shutil.copytree(catalog_model.DATA_DIR, tmp_path / "data")
    monkeypatch.setattr(catalog_model, "DATA_DIR", tmp_path / "data")
    monkeypatch.setattr(catalog_model, "MANIFEST", tmp_path / "data" / "MANIFEST.json")
    target = tmp_path / "data" / "2026.11" / "package_managers.json"
    target.write_text(target.read_text().replace("pypi.org", "pypi.org.evil-mirror.io"))
    problems = verify_manifest()
    assert len(problems) == 1 and "2026.11/package_managers.json changed after publication" in problems[0]


def test_a_version_directory_without_manifest_entries_is_detected(tmp_path, monkeypatch):
    shutil.copytree(catalog_model.DATA_DIR, tmp_path / "data")
    monkeypatch.setattr(catalog_model, "DATA_DIR", tmp_path / "data")
    monkeypatch.setattr(catalog_model, "MANIFEST", tmp_path / "data" / "MANIFEST.json")
    shutil.copytree(tmp_path / "data" / VERSIONS[-1], tmp_path / "data" / "2099.01")
    assert sorted(verify_manifest()) == [f"2099.01/{name} is not in the manifest" for name in sorted(catalog_model.FILES)]


def test_the_published_versions_and_each_file_names_its_own():
    assert VERSIONS[:2] == ("2026.11", "2026.12")  # published versions are never removed
    for version in VERSIONS:
        for name in catalog_model.FILES:
            assert json.loads((catalog_model.DATA_DIR / version / name).read_text())["version"] == version, (version, name)


def test_a_new_version_is_its_own_catalog_with_its_own_digest():
    assert len({load_catalog(v).digest for v in VERSIONS}) == len(VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_ecosystem_lists_exact_hosts_with_a_source(version):
    cat = load_catalog(version)
    assert set(cat.package_managers) == set(ECOSYSTEMS)
    for eco, hosts in cat.package_managers.items():
        assert hosts, eco
        assert len({(h.host, h.port) for h in hosts}) == len(hosts), eco
        for h in hosts:
            assert h.source and 1 <= h.port <= 65535 and "*" not in h.host
    assert {h.port for h in cat.package_managers["apt"]} == {80}


@pytest.mark.parametrize("version", VERSIONS)
def test_no_shipped_provider_is_certified_security_boundary(version):
    assert {p.egress_certification for p in load_catalog(version).providers} == {"advisory_filter"}


def test_2026_12_adds_yarn_1s_registry_to_npm_and_changes_nothing_else():
    old, new = load_catalog("2026.11"), load_catalog("2026.12")
    hosts = {v: {e: {(h.host, h.port) for h in hs} for e, hs in c.package_managers.items()} for v, c in (("old", old), ("new", new))}
    assert hosts["new"]["npm"] - hosts["old"]["npm"] == {("registry.yarnpkg.com", 443)}
    assert hosts["new"]["npm"] >= hosts["old"]["npm"]
    assert {e: h for e, h in hosts["new"].items() if e != "npm"} == {e: h for e, h in hosts["old"].items() if e != "npm"}
    assert (new.axes, new.providers) == (old.axes, old.providers)
    assert new.special_purpose.model_copy(update={"version": "2026.11"}) == old.special_purpose


@pytest.mark.parametrize(
    "address",
    ["169.254.169.254", "169.254.170.2", "192.0.0.192", "100.100.100.200", "fd00:ec2::254", "100.64.0.1", "10.1.2.3",
     "127.0.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "fe80::1", "fec0::1", "ff02::1", "64:ff9b::1",
     "::ffff:1.2.3.4", "4000::1", "2001:db8::1", "192.0.2.1", "198.18.0.1"],
)
def test_special_addresses_are_in_the_table(address):
    assert CAT.special_purpose.lookup(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "140.82.112.6", "2606:4700::1111", "2a00:1450:4001::1"])
def test_public_addresses_are_not(address):
    assert CAT.special_purpose.lookup(ipaddress.ip_address(address)) is None


def test_metadata_entries_win_over_their_containing_range():
    assert CAT.special_purpose.lookup(ipaddress.ip_address("169.254.169.254")).kind == "metadata"


def test_table_is_stamped_and_strict():
    assert CAT.special_purpose.registry_date
    for r in CAT.special_purpose.ranges:
        ipaddress.ip_network(r.cidr, strict=True)
