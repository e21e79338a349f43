"""The fleet's release-signing key: `edgetune fleet key create`, and loading it to sign a release.

The private key is an ed25519 key in PKCS#8 PEM, mode 0600, kept outside the state dir (a backup or a copy of the
fleet DB must not carry it; by default it sits in the config dir). The public key goes beside it as `<key>.pub`
(PEM), for the devices' `[model_update] trusted_keys`. Rotation: create a new key, add its public key to the
devices' list, publish with the new key, then drop the old one from the list.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetune import paths
from edgetune.errors import BadInput
from edgetune.release import key_id, raw_public


@dataclass(frozen=True)
class KeyFiles:
    private: Path
    public: Path
    key_id: str


def default_key_path() -> Path:
    return paths.config_dir() / "fleet-keys" / "release.key"


def _public_pem(private: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return private.public_key().public_bytes(serialization.Encoding.PEM,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)


def _outside_state_dir(path: Path) -> None:
    state = paths.state_dir().resolve()
    if path.resolve().is_relative_to(state):
        raise BadInput(f"{path}: the signing key must live outside the state dir {state} (backups and copies of "
                       "the fleet DB would carry it); pick another --out")


def create_key(path: Path | None) -> KeyFiles:
    """A new key pair at `path` (0600) and `path`.pub; refuses to overwrite either."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    explicit = path is not None
    path = Path(path) if path else default_key_path()
    pub = path.with_name(path.name + ".pub")
    _outside_state_dir(path)
    for p in (path, pub):
        if p.exists():
            raise BadInput(f"{p} exists: a signing key is never overwritten (devices trust it); pick another --out, "
                           "or remove it yourself if it is really unused")
    key = Ed25519PrivateKey.generate()
    try:
        _write_pair(path, pub, key)
    except OSError as e:
        where = "--out" if explicit else "--out, or set CONFIGURATION_DIRECTORY to a directory you can write"
        why = "a parent is not a directory" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror
        raise BadInput(f"cannot write the signing key to {path}: {why or e}; pick another {where}") from None
    return KeyFiles(path, pub, key_id(raw_public(key.public_key())))


def _write_pair(path: Path, pub: Path, key: Any) -> None:
    """The private key (0600 from its first byte) and its public key; never half a pair: a private key whose
    public half could not be written is removed, so the next attempt does not find it "exists"."""
    from cryptography.hazmat.primitives import serialization

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        pub.write_bytes(_public_pem(key))
    except OSError:
        path.unlink(missing_ok=True)
        raise


def load_private_key(path: Path) -> Any:
    """The Ed25519PrivateKey in `path`; BadInput naming the file when it is missing, open to others, or not one."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        st = path.stat()
        data = path.read_bytes()
    except OSError as e:
        raise BadInput(f"signing key {path}: {e.strerror}; create one with `edgetune fleet key create`") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BadInput(f"signing key {path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                       f"chmod 600 {path}")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise BadInput(f"signing key {path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(f"signing key {path} is not an ed25519 key")
    return key
