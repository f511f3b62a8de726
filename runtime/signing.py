"""Who built an artifact: an optional ed25519 signature over its manifest.

The manifest lists every other file with its sha256, so a signature over the manifest's exact
bytes covers the whole artifact. `mxc compile --sign KEY` writes it to manifest.json.sig (the
raw 64 signature bytes). A runtime given trusted public keys (trusted_keys=..., or the
MXC_TRUSTED_KEYS environment variable: PEM files separated by os.pathsep) checks the signature
before it reads anything else of the artifact, and refuses one that no trusted key signed.
"""

from __future__ import annotations

import os
from pathlib import Path

from mxc.runtime.artifact import MANIFEST_NAME, ArtifactError

SIGNATURE_NAME = MANIFEST_NAME + ".sig"
TRUSTED_KEYS_ENV = "MXC_TRUSTED_KEYS"
_MAX_KEY_BYTES = 64 * 1024


class SigningError(ValueError):
    """A key file that cannot be used; names the file."""


def _read_pem(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_KEY_BYTES + 1)
    except OSError as err:
        raise SigningError(f"cannot read key {path}: {err.strerror or err}") from None
    if len(data) > _MAX_KEY_BYTES:
        raise SigningError(f"{path} is too large to be a key")
    return data


def load_private_key(path: str | Path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    try:
        key = load_pem_private_key(_read_pem(Path(path)), password=None)
    except (ValueError, TypeError) as err:
        raise SigningError(f"{path} is not an unencrypted PEM private key: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{path} is not an ed25519 private key")
    return key


def load_public_key(path: str | Path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(_read_pem(Path(path)))
    except (ValueError, TypeError) as err:
        raise SigningError(f"{path} is not a PEM public key: {err}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{path} is not an ed25519 public key")
    return key


def sign_artifact(directory: str | Path, private_key_path: str | Path) -> Path:
    """Sign the artifact's manifest with the key in `private_key_path`; returns the signature file."""
    directory = Path(directory)
    key = load_private_key(private_key_path)
    signature = directory / SIGNATURE_NAME
    signature.write_bytes(key.sign((directory / MANIFEST_NAME).read_bytes()))
    return signature


def trusted_keys_from_env() -> list[str]:
    value = os.environ.get(TRUSTED_KEYS_ENV, "")
    return [part for part in value.split(os.pathsep) if part]


def check_signature(directory: str | Path, manifest_bytes: bytes, trusted_keys: list[str | Path]) -> None:
    """Raise ArtifactError unless manifest.json.sig is a signature of `manifest_bytes` by one of
    `trusted_keys` (paths of PEM public keys)."""
    from cryptography.exceptions import InvalidSignature

    directory = Path(directory)
    try:
        keys = [load_public_key(path) for path in trusted_keys]
    except SigningError as err:
        raise ArtifactError(str(err)) from None
    path = directory / SIGNATURE_NAME
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"{directory} is not signed (no {SIGNATURE_NAME}), and trusted keys were given: "
                            "only artifacts signed by a trusted key are loaded")
    with open(path, "rb") as f:
        signature = f.read(65)
    for key in keys:
        try:
            key.verify(signature, manifest_bytes)
            return
        except InvalidSignature:
            continue
    raise ArtifactError(f"{directory} is not signed by a trusted key (its {SIGNATURE_NAME} matches none of "
                        f"{', '.join(str(k) for k in trusted_keys)}), or its manifest was modified after signing")
