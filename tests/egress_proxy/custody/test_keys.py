"""The keys directory: modes, ownership, symlinks, read-only mounts, malformed files, never quoted."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from egress_proxy.custody import keys as keyfiles
from egress_proxy.custody.keys import (
    KeyFileError,
    init_keys,
    load_custody_keys,
    load_lease_key,
)
from egress_proxy.custody.records import (
    Address,
)
from egress_proxy.custody.sqlite import CustodyStore

ROOT = Path(__file__).resolve().parents[3]
A = Address("acme", "github", "gh-prod")
VALUE = b"ghp_0123456789abcdefCANARYvalue"


def test_init_keys_modes_and_contents(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ring = init_keys(tmp_path / "k")
    finally:
        os.umask(old)
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    for name in ("custody.key", "lease.key"):
        assert (tmp_path / "k" / name).stat().st_mode & 0o777 == 0o600
    assert len(ring.ids) == 1 and ring.active == ring.ids[0]
    assert len(load_lease_key(tmp_path / "k")) == 32
    assert load_lease_key(tmp_path / "k") != ring.material(ring.active)
    doc = json.loads((tmp_path / "k" / "custody.key").read_text())
    assert doc["format"] == "egresslaw.custody-keys/1"
    assert "material" not in repr(ring) and base64.b64encode(ring.material(ring.active)).decode() not in repr(ring.keys())


def test_init_keys_tightens_an_existing_directory(tmp_path: Path) -> None:
    (tmp_path / "k").mkdir(mode=0o755)
    os.chmod(tmp_path / "k", 0o755)
    init_keys(tmp_path / "k")
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700


def test_init_keys_never_overwrites(keys: Path) -> None:
    before = (keys / "custody.key").read_bytes(), (keys / "lease.key").read_bytes()
    with pytest.raises(KeyFileError, match="already exists; refusing to overwrite"):
        init_keys(keys)
    (keys / "custody.key").unlink()
    with pytest.raises(KeyFileError, match="lease.key` already exists"):
        init_keys(keys)
    assert (keys / "lease.key").read_bytes() == before[1]


def _key_bytes_in(message: str, keys: Path) -> bool:
    doc = json.loads((keys / "custody.key").read_text())
    lease = json.loads((keys / "lease.key").read_text())
    blobs = [k["key"] for k in doc["keys"]] + [lease["key"]]
    return any(b in message or base64.b64decode(b).hex() in message for b in blobs)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o620, 0o601])
@pytest.mark.parametrize("name", ["custody.key", "lease.key"])
def test_key_file_with_wider_mode_is_refused(keys: Path, mode: int, name: str) -> None:
    os.chmod(keys / name, mode)
    loader = load_custody_keys if name == "custody.key" else load_lease_key
    with pytest.raises(KeyFileError, match=f"`{keys / name}` is accessible by group or others") as info:
        loader(keys)
    assert info.value.help == f"run `chmod 600 {keys / name}`"
    assert not _key_bytes_in(str(info.value), keys)


def test_owner_only_modes_are_accepted(keys: Path) -> None:
    for mode in (0o400, 0o600, 0o700):
        os.chmod(keys / "custody.key", mode)
        assert load_custody_keys(keys).active


def test_store_refuses_a_0644_key_file(tmp_path: Path, keys: Path) -> None:
    os.chmod(keys / "custody.key", 0o644)
    with pytest.raises(KeyFileError, match="chmod|group or others"):
        CustodyStore(tmp_path / "c.db", keys)
    assert not (tmp_path / "c.db").exists()


def test_group_writable_directory_is_refused(keys: Path) -> None:
    os.chmod(keys, 0o777)
    with pytest.raises(KeyFileError, match=f"keys directory `{keys}` is writable by group or others") as info:
        load_custody_keys(keys)
    assert info.value.help == f"run `chmod 700 {keys}`"


def test_a_key_symlinked_out_of_the_keys_directory_is_refused(keys: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.key"
    os.rename(keys / "custody.key", target)
    os.symlink(target, keys / "custody.key")
    with pytest.raises(KeyFileError) as info:
        load_custody_keys(keys)
    assert str(info.value) == f"key file `{keys / 'custody.key'}` is a symlink to `{target}`, outside the keys directory"
    assert "copy the key into" in info.value.help


def _secret_layout(keys: Path) -> Path:
    """Rearrange `keys` the way a Kubernetes Secret volume looks: KEY -> ..data/KEY, ..data -> ..<timestamp>/."""
    stamp = keys / "..2026_01_01_00_00_00.000000001"
    stamp.mkdir(mode=0o755)
    for name in ("custody.key", "lease.key"):
        os.rename(keys / name, stamp / name)
    os.symlink(stamp.name, keys / "..data")
    for name in ("custody.key", "lease.key"):
        os.symlink(f"..data/{name}", keys / name)
    return stamp


def test_keys_mounted_as_a_kubernetes_secret_are_read_through_their_symlinks(keys: Path, tmp_path: Path) -> None:
    ring = load_custody_keys(keys)
    lease = load_lease_key(keys)
    _secret_layout(keys)
    assert load_custody_keys(keys).ids == ring.ids and load_lease_key(keys) == lease
    with CustodyStore(tmp_path / "c.db", keys) as store:
        store.put(A, VALUE)
        assert store.open(A).reveal() == VALUE


def test_the_permission_check_is_on_the_final_file(keys: Path) -> None:
    stamp = _secret_layout(keys)
    os.chmod(stamp / "lease.key", 0o644)
    with pytest.raises(KeyFileError) as info:
        load_lease_key(keys)
    assert str(info.value) == f"key file `{keys / 'lease.key'}` (-> `{stamp / 'lease.key'}`) is accessible by group or others (mode 0644)"
    assert info.value.help == f"run `chmod 600 {stamp / 'lease.key'}`"
    os.chmod(stamp / "lease.key", 0o600)
    os.chmod(stamp, 0o777)  # the directory the link resolves into is checked too
    with pytest.raises(KeyFileError, match=f"keys directory `{stamp}` is writable by group or others"):
        load_lease_key(keys)


def test_on_a_read_only_mount_group_access_is_accepted_never_others(keys: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What the kubelet writes for `defaultMode: 0440` + `fsGroup`: root-owned, group-readable, read-only mount.
    stamp = _secret_layout(keys)
    os.chmod(keys, 0o1777)
    os.chmod(stamp / "custody.key", 0o440)
    with pytest.raises(KeyFileError, match="writable by group or others"):
        load_custody_keys(keys)  # a writable directory like that is refused...
    monkeypatch.setattr(keyfiles, "_read_only", lambda path: True)
    assert load_custody_keys(keys).active  # ...but nobody can write a read-only mount
    monkeypatch.setattr(keyfiles.os, "geteuid", lambda: 10001)  # a non-root proxy; the file is someone else's
    assert load_custody_keys(keys).active
    os.chmod(stamp / "custody.key", 0o444)
    with pytest.raises(KeyFileError) as info:
        load_custody_keys(keys)
    assert str(info.value).endswith("is readable by others (mode 0444)")
    assert "defaultMode: 0440" in info.value.help and "fsGroup" in info.value.help


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare` with user namespaces to mount a read-only tmpfs")
def test_keys_on_a_real_read_only_secret_mount(keys: Path, tmp_path: Path) -> None:
    # A real read-only tmpfs in a private mount namespace, laid out as the kubelet does (1777 mount point,
    # `..data` symlinks, 0440 files): egresslaw reads the keys and mints a lease from them.
    mount = tmp_path / "secret"
    mount.mkdir()
    script = textwrap.dedent(
        f"""
        set -e
        mount -t tmpfs -o mode=1777 tmpfs {mount}
        mkdir -m 755 {mount}/..2026_01_01
        cp {keys}/custody.key {keys}/lease.key {mount}/..2026_01_01/
        chmod 440 {mount}/..2026_01_01/custody.key {mount}/..2026_01_01/lease.key
        ln -s ..2026_01_01 {mount}/..data
        ln -s ..data/custody.key {mount}/custody.key
        ln -s ..data/lease.key {mount}/lease.key
        mount -o remount,ro {mount}
        {sys.executable} -c 'from egress_proxy.custody.keys import load_custody_keys; print(load_custody_keys("{mount}").active)'
        {sys.executable} -m egresslaw lease --keys {mount} --profile p --subject s --no-subject-check
        printf v | {sys.executable} -m egresslaw custody put --keys {mount} --store {tmp_path}/c.db --workspace a --connection b --handle c >/dev/null
        {sys.executable} -m egresslaw custody rotate --keys {mount} --store {tmp_path}/c.db 2> {tmp_path}/rotate.err || echo "rotate exit $?"
        """
    )
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    active, lease, rotate = proc.stdout.splitlines()
    assert active == load_custody_keys(keys).active and lease and " " not in lease
    assert rotate == "rotate exit 2"  # a Secret is changed where it is managed, and the error says so
    assert "help: the keys directory is a read-only mount (a Kubernetes Secret?)" in (tmp_path / "rotate.err").read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_key_file_owned_by_someone_else_is_refused(keys: Path) -> None:
    os.chown(keys / "lease.key", 65534, 65534)
    with pytest.raises(KeyFileError, match="is not owned by the current user"):
        load_lease_key(keys)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("not json", "not JSON"),
        ('{"format": "other"}', "expected format"),
        ('{"format": "egresslaw.custody-keys/1", "keys": []}', "no keys"),
        ('{"format": "egresslaw.custody-keys/1", "keys": [{"id": "ck-1", "created": "x", "key": "c2VjcmV0LWtleS1ieXRlcw=="}]}', "not 32 bytes"),
        ('{"format": "egresslaw.custody-keys/1", "keys": [{"id": "ck-1", "created": "x", "key": "!!c2VjcmV0"}]}', "not valid base64"),
    ],
)
def test_malformed_key_file_never_quotes_it(keys: Path, text: str, why: str) -> None:
    path = keys / "custody.key"
    path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    with pytest.raises(KeyFileError, match=why) as info:
        load_custody_keys(keys)
    assert "c2VjcmV0" not in str(info.value) and "secret-key-bytes" not in str(info.value)


def test_missing_keys_directory(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist") as info:
        load_custody_keys(tmp_path / "nope")
    assert "keys init" in str(info.value.help)

