"""Signed tuner-model releases: the manifest the fleet signs and a device verifies, in one place for both sides.

A release is a manifest in canonical JSON (sorted keys, no spaces, UTF-8, no NaN) plus a detached ed25519
signature over exactly those bytes, so the fleet and every device agree on what was signed whatever JSON library
wrote the message. The manifest names the model file by sha256 and size, so the file itself needs no signature:
a device checks both before it stages the file. Devices trust a list of public keys (key rotation: add the new key
to the devices, start signing with it, retire the old one); a manifest names its key by `key_id`, the first 16 hex
digits of the sha256 of the raw 32-byte public key.

Checks a device makes, in order, each with its own reason code on the model state topic: the manifest is well
formed; its key is trusted; the signature holds; it has not expired; it is addressed to this device's ISA; it does
not need a newer edgetune; its version is newer than the current model's unless it is a signed rollback.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgetune.errors import BadInput

MAX_MODEL_BYTES = 64 << 20  # the device budget is 5 MB; anything near this limit is a mistake or an attack
PROMPT_FORMAT = "edgetune-prompt-4"  # tuner.model.inference.PROMPT_FORMAT: what devices speak
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
KEY_ID_RE = re.compile(r"[0-9a-f]{16}")
CHUNK_BYTES_MIN, CHUNK_BYTES_MAX = 1024, 1 << 20  # the chunk sizes of an MQTT transfer (edgetune.protocol)

# reason codes, as the device reports them on model/state
MALFORMED = "malformed"
UNKNOWN_KEY = "unknown_key"
BAD_SIGNATURE = "bad_signature"
EXPIRED = "expired"
NOT_ADDRESSED = "not_addressed"
TOO_OLD = "edgetune_too_old"
DOWNGRADE = "downgrade"
TOO_LARGE = "too_large"
SIZE_MISMATCH = "size_mismatch"
CHECKSUM = "checksum"
WRONG_PROMPT_FORMAT = "prompt_format"  # the manifest, or the file's metadata, names another prompt format
# the device's later steps, reported with `failed` (nothing was staged) or `rolled_back` (the health check)
DISK_FULL = "disk_full"
DOWNLOAD_FAILED = "download_failed"
INTERRUPTED = "interrupted"  # the device restarted during the health check more often than it retries
WITHDRAWN = "withdrawn"  # the fleet withdrew the release (empty retained message) before it was committed
LOAD_FAILED = "load_failed"
INVALID_PROPOSALS = "invalid_proposals"
TOO_SLOW = "too_slow"
REGRESSION = "regression"


class ReleaseRejected(BadInput):
    """A manifest or model file a device must not install; `reason` is one of the codes above."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class Manifest:
    name: str
    version: int  # monotonic per fleet; a device never goes down unless `rollback` is set
    sha256: str
    size: int
    prompt_format: str
    spaces: dict[str, str]  # kernel -> source/space hash the model was trained for
    min_edgetune: str
    expires_at: float  # unix seconds
    key_id: str
    url: str  # path on the fleet server, `/releases/{sha256}`
    issued_at: float
    rollback: bool = False  # a signed return to an older version
    target_isa: tuple[str, ...] = field(default=())  # empty: every ISA
    # the file is offered over MQTT too (edgetune.protocol model/chunk), cut at this many bytes; None: HTTP only
    mqtt_chunk_size: int | None = None

    def doc(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_isa"] = list(self.target_isa)
        chunk = d.pop("mqtt_chunk_size")
        if chunk is not None:
            d["mqtt"] = {"chunk_size": chunk}
        return d


def canonical(doc: dict[str, Any]) -> bytes:
    """The bytes that are signed: one spelling of a JSON object."""
    try:
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except ValueError as e:
        raise ReleaseRejected(MALFORMED, f"manifest is not canonical JSON ({e})") from None


def key_id(raw_public_key: bytes) -> str:
    return hashlib.sha256(raw_public_key).hexdigest()[:16]


def _need(doc: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    v = doc.get(name)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise ReleaseRejected(MALFORMED, f"manifest field {name!r} is {v!r}: expected {kind}")
    return v


def parse_manifest(doc: Any) -> Manifest:
    """A Manifest from its JSON object, or ReleaseRejected(malformed) naming the bad field. Fields this version does
    not know are ignored (as TUF clients do): they are signed with the rest, so only the fleet can add them, and a
    fleet newer than its devices must still reach them; a release that needs a newer device says so in
    `min_edgetune`."""
    if not isinstance(doc, dict):
        raise ReleaseRejected(MALFORMED, f"manifest is a {type(doc).__name__}, not a JSON object")
    name, sha, kid = _need(doc, "name", str), _need(doc, "sha256", str), _need(doc, "key_id", str)
    if not NAME_RE.fullmatch(name):
        raise ReleaseRejected(MALFORMED, f"manifest name {name[:80]!r}: 1-64 of A-Z a-z 0-9 _ . -")
    if not SHA256_RE.fullmatch(sha) or not KEY_ID_RE.fullmatch(kid):
        raise ReleaseRejected(MALFORMED, "sha256 must be 64 and key_id 16 lowercase hex digits")
    version, size = _need(doc, "version", int), _need(doc, "size", int)
    if version < 1 or size < 1:
        raise ReleaseRejected(MALFORMED, f"version {version} and size {size} must be positive")
    if size > MAX_MODEL_BYTES:
        raise ReleaseRejected(TOO_LARGE, f"model of {size} bytes is over the {MAX_MODEL_BYTES}-byte limit")
    expires, issued = _need(doc, "expires_at", (int, float)), _need(doc, "issued_at", (int, float))
    if not (math.isfinite(expires) and math.isfinite(issued)):
        raise ReleaseRejected(MALFORMED, "expires_at and issued_at must be finite unix times")
    url = _need(doc, "url", str)
    if url != f"/releases/{sha}":
        raise ReleaseRejected(MALFORMED, f"url {url[:100]!r} must be /releases/<sha256 of the model>")
    spaces = _need(doc, "spaces", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in spaces.items()):
        raise ReleaseRejected(MALFORMED, "spaces must map kernel names to space hashes")
    isas = doc.get("target_isa", [])
    if not isinstance(isas, list) or not all(isinstance(i, str) for i in isas):
        raise ReleaseRejected(MALFORMED, "target_isa must be a list of ISA names")
    return Manifest(name=name, version=version, sha256=sha, size=size, mqtt_chunk_size=_mqtt_chunk_size(doc),
                    prompt_format=_need(doc, "prompt_format", str), spaces=dict(spaces),
                    min_edgetune=_need(doc, "min_edgetune", str), expires_at=float(expires), key_id=kid, url=url,
                    issued_at=float(issued), rollback=bool(_need(doc, "rollback", bool)) if "rollback" in doc
                    else False, target_isa=tuple(isas))


def _mqtt_chunk_size(doc: dict) -> int | None:
    """The manifest's optional `mqtt` source: {"chunk_size": bytes}."""
    if "mqtt" not in doc:
        return None
    src = doc["mqtt"]
    size = src.get("chunk_size") if isinstance(src, dict) and set(src) == {"chunk_size"} else None
    if not isinstance(size, int) or isinstance(size, bool) or not CHUNK_BYTES_MIN <= size <= CHUNK_BYTES_MAX:
        raise ReleaseRejected(MALFORMED, f"manifest field 'mqtt' is {str(src)[:80]}: expected {{\"chunk_size\": "
                                         f"{CHUNK_BYTES_MIN}..{CHUNK_BYTES_MAX}}}")
    return size


# ---- keys and signatures -----------------------------------------------------------------------------------------

def public_key_from_text(text: str) -> Any:
    """An Ed25519PublicKey from a PEM block or the base64 of its 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text = text.strip()
    try:
        if text.startswith("-----BEGIN"):
            key = serialization.load_pem_public_key(text.encode())
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError("not an ed25519 key")
            return key
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(text, validate=True))
    except (ValueError, binascii.Error) as e:
        raise BadInput(f"not an ed25519 public key (PEM or base64 of 32 bytes): {e}") from None


def raw_public(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_trusted_keys(paths: list[Path]) -> dict[str, Any]:
    """key_id -> public key for every trusted key file; a file that is not a key is a BadInput naming it."""
    keys: dict[str, Any] = {}
    for p in paths:
        try:
            key = public_key_from_text(Path(p).read_text())
        except (OSError, BadInput) as e:
            raise BadInput(f"trusted key {p}: {e}") from None
        keys[key_id(raw_public(key))] = key
    return keys


def sign(doc: dict[str, Any], private_key: Any) -> str:
    """The base64 ed25519 signature of the manifest's canonical bytes."""
    return base64.b64encode(private_key.sign(canonical(doc))).decode()


def verify(doc: Any, signature: Any, trusted: dict[str, Any]) -> Manifest:
    """The manifest, if it is well formed and signed by a trusted key; ReleaseRejected otherwise."""
    from cryptography.exceptions import InvalidSignature

    m = parse_manifest(doc)
    key = trusted.get(m.key_id)
    if key is None:
        raise ReleaseRejected(UNKNOWN_KEY, f"key {m.key_id} is not among the {len(trusted)} trusted keys")
    try:
        sig = base64.b64decode(signature if isinstance(signature, str) else "", validate=True)
        key.verify(sig, canonical(doc))
    except (InvalidSignature, binascii.Error, ValueError):
        raise ReleaseRejected(BAD_SIGNATURE, f"signature does not match manifest {m.name} v{m.version}") from None
    return m


# ---- applicability -----------------------------------------------------------------------------------------------

def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_applicable(m: Manifest, *, now: float, isa: str, edgetune_version: str,
                     current_version: int | None) -> None:
    """ReleaseRejected unless this verified manifest may be installed on this device now."""
    if m.expires_at <= now:
        raise ReleaseRejected(EXPIRED, f"manifest {m.name} v{m.version} expired at {m.expires_at:.0f} (now {now:.0f})")
    if m.target_isa and isa not in m.target_isa:
        raise ReleaseRejected(NOT_ADDRESSED, f"release targets ISA {list(m.target_isa)}, this device is {isa}")
    if _version_tuple(edgetune_version) < _version_tuple(m.min_edgetune):
        raise ReleaseRejected(TOO_OLD, f"needs edgetune >= {m.min_edgetune}, this is {edgetune_version}")
    if current_version is not None and m.version <= current_version and not m.rollback:
        raise ReleaseRejected(DOWNGRADE, f"v{m.version} is not newer than the current v{current_version} and is "
                                         "not a signed rollback")


def check_file(m: Manifest, path: Path) -> None:
    """ReleaseRejected unless the downloaded file is exactly the one the manifest names."""
    size = path.stat().st_size
    if size != m.size:
        raise ReleaseRejected(SIZE_MISMATCH, f"{path.name}: {size} bytes, the manifest says {m.size}")
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != m.sha256:
        raise ReleaseRejected(CHECKSUM, f"{path.name}: sha256 {h.hexdigest()[:16]}… is not the manifest's "
                                        f"{m.sha256[:16]}…")
