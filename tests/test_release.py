"""Signed model releases (edgetune/release.py): what a device accepts and what it refuses, with which reason."""

import base64
import hashlib
import json
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgetune import release as rel
from edgetune.errors import BadInput

NOW = 1_800_000_000.0


def keypair():
    k = Ed25519PrivateKey.generate()
    return k, rel.key_id(rel.raw_public(k.public_key()))


def manifest(kid: str, **over) -> dict:
    sha = hashlib.sha256(b"model").hexdigest()
    doc = dict(name="edgetune-tuner", version=3, sha256=sha, size=5, prompt_format=rel.PROMPT_FORMAT,
               spaces={"gemm": "abc"}, min_edgetune="0.1.0", expires_at=NOW + 3600, key_id=kid,
               url=f"/releases/{sha}", issued_at=NOW, rollback=False, target_isa=[])
    doc.update(over)
    return doc


def test_a_signed_manifest_verifies_and_round_trips():
    k, kid = keypair()
    doc = manifest(kid)
    m = rel.verify(doc, rel.sign(doc, k), {kid: k.public_key()})
    assert m.doc() == doc and m.version == 3
    # the signature covers the canonical bytes, not the spelling: a re-serialised manifest still verifies
    respelled = json.loads(json.dumps(doc, indent=2))
    assert rel.verify(respelled, rel.sign(doc, k), {kid: k.public_key()}) == m
    # the optional MQTT source (the file in chunks of this size) is signed with the rest
    offered = manifest(kid, mqtt={"chunk_size": 65536})
    m = rel.verify(offered, rel.sign(offered, k), {kid: k.public_key()})
    assert m.mqtt_chunk_size == 65536 and m.doc() == offered
    # a field from a newer fleet, signed with the rest: ignored, so devices older than their fleet still update
    newer = manifest(kid, delta={"from_version": 2}, priority="low")
    m = rel.verify(newer, rel.sign(newer, k), {kid: k.public_key()})
    assert m.version == 3 and m.doc() == manifest(kid)


@pytest.mark.parametrize("change, reason", [
    (lambda d, s, k: ({**d, "version": 4}, s, k), rel.BAD_SIGNATURE),  # tampered
    (lambda d, s, k: (d, base64.b64encode(b"x" * 64).decode(), k), rel.BAD_SIGNATURE),  # forged
    (lambda d, s, k: (d, "not base64!", k), rel.BAD_SIGNATURE),
    (lambda d, s, k: (d, s, {}), rel.UNKNOWN_KEY),
    (lambda d, s, k: ({**d, "size": rel.MAX_MODEL_BYTES + 1}, s, k), rel.TOO_LARGE),
    (lambda d, s, k: ({**d, "url": "/etc/passwd"}, s, k), rel.MALFORMED),
    (lambda d, s, k: ({**d, "extra": 1}, s, k), rel.BAD_SIGNATURE),  # a field added after signing
    (lambda d, s, k: ({**d, "mqtt": {"chunk_size": 10}}, s, k), rel.MALFORMED),
    (lambda d, s, k: ({**d, "mqtt": {"chunk_size": 65536, "topic": "x"}}, s, k), rel.MALFORMED),
    (lambda d, s, k: ([d], s, k), rel.MALFORMED),
])
def test_tampered_forged_or_malformed_manifests_are_rejected_with_a_reason(change, reason):
    k, kid = keypair()
    doc = manifest(kid)
    d, s, trusted = change(doc, rel.sign(doc, k), {kid: k.public_key()})
    with pytest.raises(rel.ReleaseRejected) as e:
        rel.verify(d, s, trusted)
    assert e.value.reason == reason


def test_a_key_from_another_fleet_does_not_verify_even_with_a_matching_key_id():
    k, kid = keypair()
    other, _ = keypair()
    doc = manifest(kid)
    with pytest.raises(rel.ReleaseRejected) as e:
        rel.verify(doc, rel.sign(doc, other), {kid: k.public_key()})
    assert e.value.reason == rel.BAD_SIGNATURE


@pytest.mark.parametrize("over, kwargs, reason", [
    ({"expires_at": NOW - 1}, {}, rel.EXPIRED),
    ({"target_isa": ["armv8-a"]}, {}, rel.NOT_ADDRESSED),
    ({"min_edgetune": "0.2.0"}, {}, rel.TOO_OLD),
    ({"version": 2}, {}, rel.DOWNGRADE),
    ({"version": 3}, {}, rel.DOWNGRADE),
])
def test_applicability(over, kwargs, reason):
    m = rel.parse_manifest(manifest("0" * 16, **over))
    with pytest.raises(rel.ReleaseRejected) as e:
        rel.check_applicable(m, now=NOW, isa="x86-64-v4", edgetune_version="0.1.0", current_version=3, **kwargs)
    assert e.value.reason == reason


def test_a_signed_rollback_may_go_down_and_a_newer_release_applies():
    for over in ({"version": 2, "rollback": True}, {"version": 4, "target_isa": ["x86-64-v4"]}):
        m = rel.parse_manifest(manifest("0" * 16, **over))
        rel.check_applicable(m, now=NOW, isa="x86-64-v4", edgetune_version="0.1.0", current_version=3)


def test_the_file_must_match_size_and_checksum(tmp_path):
    m = rel.parse_manifest(manifest("0" * 16))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"model")
    rel.check_file(m, f)
    for data, reason in ((b"mode", rel.SIZE_MISMATCH), (b"MODEL", rel.CHECKSUM)):
        f.write_bytes(data)
        with pytest.raises(rel.ReleaseRejected) as e:
            rel.check_file(m, f)
        assert e.value.reason == reason


def test_trusted_keys_load_from_pem_or_base64_and_bad_files_are_named(tmp_path):
    from cryptography.hazmat.primitives import serialization

    k, kid = keypair()
    pem = k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "a.pem").write_bytes(pem)
    (tmp_path / "b.pub").write_text(base64.b64encode(rel.raw_public(k.public_key())).decode())
    (tmp_path / "bad.pub").write_text("hello")
    assert list(rel.load_trusted_keys([tmp_path / "a.pem", tmp_path / "b.pub"])) == [kid]
    with pytest.raises(BadInput, match="bad.pub"):
        rel.load_trusted_keys([tmp_path / "bad.pub"])
