"""Signed proof reports: the deploy pipeline's prover signs, the proxy accepts only its key's reports.

`egresslaw keys init --proof-signing --dir KEYS` writes `KEYS/proof-signing.key` (the Ed25519
private key, JSON, mode 0600, checked like every key file) and `KEYS/proof-signing.pub` (the
public key, PEM). `prove --sign KEYS/proof-signing.key` adds
`"signature": {"alg": "ed25519", "key_id": …, "value": …}` over the canonical JSON of every other
field of the report (artifact digest, check set, verdicts, counterexamples, versions, timings);
`proxy --trust-proofs KEYS/proof-signing.pub` refuses a report that is unsigned, signed by
another key, or changed after signing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from egress_proxy.custody.keys import (
    KeyFileError,
    check_directory,
    read_private_json,
    write_new,
)
from proofs.errors import ProofError

PRIVATE_FILE = "proof-signing.key"
PUBLIC_FILE = "proof-signing.pub"
KEY_FORMAT = "egresslaw.proof-signing-key/1"
ALG = "ed25519"


class SigningError(ProofError):
    """A signing key that cannot be used, or a report whose signature does not verify."""


def key_id(public: Ed25519PublicKey) -> str:
    """The first 16 hex digits of sha256 over the raw public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def init_signing_keys(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Create the key pair in `directory` (0700); never overwrite. Returns (private, public) paths."""
    root = Path(directory)
    for name in (PRIVATE_FILE, PUBLIC_FILE):
        if (root / name).exists() or (root / name).is_symlink():
            raise SigningError(f"`{root / name}` already exists; refusing to overwrite it")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_directory(root)
        private = Ed25519PrivateKey.generate()
        seed = private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())
        doc = {"format": KEY_FORMAT, "key_id": key_id(private.public_key()), "key": base64.b64encode(seed).decode("ascii")}
        write_new(root / PRIVATE_FILE, json.dumps(doc, indent=2) + "\n")
    except KeyFileError as exc:
        raise SigningError(exc.message, exc.help) from None
    except OSError as exc:
        raise SigningError(f"cannot create `{root}`: {exc.strerror or exc.__class__.__name__}") from None
    pem = private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (root / PUBLIC_FILE).write_bytes(pem)
    return root / PRIVATE_FILE, root / PUBLIC_FILE


def load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    """Read a private signing key; refused unless private to the current user (as every key file)."""
    try:
        doc = read_private_json(Path(path), KEY_FORMAT)
        seed = base64.b64decode(doc["key"], validate=True)
        return Ed25519PrivateKey.from_private_bytes(seed)
    except KeyFileError as exc:
        raise SigningError(exc.message, exc.help) from None
    except (KeyError, TypeError, ValueError, binascii.Error):
        raise SigningError(f"signing key `{path}` is malformed") from None


def load_public_key(path: str | os.PathLike[str]) -> Ed25519PublicKey:
    """Read a PEM Ed25519 public key."""
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except FileNotFoundError:
        raise SigningError(f"public key `{path}` does not exist") from None
    except OSError as exc:
        raise SigningError(f"cannot read public key `{path}`: {exc.strerror or exc.__class__.__name__}") from None
    except ValueError:
        raise SigningError(f"`{path}` is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"`{path}` is not an Ed25519 public key")
    return key


def payload(doc: dict[str, Any]) -> bytes:
    """The signed bytes: the canonical JSON of the report without its `signature`."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def sign_document(doc: dict[str, Any], private: Ed25519PrivateKey) -> dict[str, str]:
    """The `signature` object for a report document."""
    value = private.sign(payload(doc))
    return {"alg": ALG, "key_id": key_id(private.public_key()), "value": base64.b64encode(value).decode("ascii")}


def verify_document(doc: object, public: Ed25519PublicKey) -> None:
    """SigningError unless `doc` carries a valid signature by `public`."""
    if not isinstance(doc, dict) or not isinstance(doc.get("signature"), dict):
        raise SigningError("the report is not signed", "sign it with `egresslaw prove --sign KEY`")
    sig = doc["signature"]
    if sig.get("alg") != ALG or sig.get("key_id") != key_id(public):
        raise SigningError(f"the report is signed by key `{sig.get('key_id')}`, not by the trusted key `{key_id(public)}`")
    try:
        public.verify(base64.b64decode(str(sig.get("value", "")), validate=True), payload(doc))
    except (InvalidSignature, binascii.Error, ValueError):
        raise SigningError("the report's signature does not verify: it was changed after signing") from None
