"""The catalog: published versions are immutable, and the special-purpose table is complete."""

from __future__ import annotations

import ipaddress
import shutil

import pytest

import catalog.model as catalog_model
from catalog import ECOSYSTEMS, load_catalog, verify_manifest

CAT = load_catalog("2026.11")


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


def test_every_ecosystem_lists_exact_hosts_with_a_source():
    assert set(CAT.package_managers) == set(ECOSYSTEMS)
    for eco, hosts in CAT.package_managers.items():
        assert hosts, eco
        for h in hosts:
            assert h.source and 1 <= h.port <= 65535 and "*" not in h.host
    assert {h.port for h in CAT.package_managers["apt"]} == {80}


def test_no_shipped_provider_is_certified_security_boundary():
    assert {p.egress_certification for p in CAT.providers} == {"advisory_filter"}


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
