"""edgetune.protocol: topics built and parsed, the id rule, payload encoding, and docs/protocol.md checked against
the module so that the published contract cannot drift from the code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from edgetune import protocol as wire
from edgetune.errors import BadInput
from edgetune.protocol import ProtocolError, Topics, parse_topic, topic_filter

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


# ---- topics and ids ----------------------------------------------------------------------------------------------

def test_every_topic_round_trips_through_build_and_parse():
    t = Topics("dev-1.a:b_c")
    for spec in wire.TOPICS:
        topic = t.of(spec, "cmd-7")
        p = parse_topic(topic)
        assert (p.device_id, p.spec) == ("dev-1.a:b_c", spec)
        assert p.command_id == ("cmd-7" if spec.has_id else None)
        assert topic.startswith("edgetune/v1/dev-1.a:b_c/") and topic.endswith(p.sub)
    assert t.cmd_res(None) == "edgetune/v1/dev-1.a:b_c/cmd/res/invalid"  # a request without a usable id
    assert (t.status, t.cmd_req, t.record) == ("edgetune/v1/dev-1.a:b_c/status", "edgetune/v1/dev-1.a:b_c/cmd/req",
                                               "edgetune/v1/dev-1.a:b_c/tuning/record")


def test_a_newer_devices_topic_parses_as_unknown_not_as_an_error():
    p = parse_topic("edgetune/v1/dev-1/ota/chunk")
    assert (p.device_id, p.sub, p.spec) == ("dev-1", "ota/chunk", None)


@pytest.mark.parametrize("bad", ["", "-lead", ".lead", "a/b", "a+b", "a#", "sp ace", "ünï", "x" * 129, None, 7])
def test_bad_ids_are_rejected_with_the_rule(bad):
    assert not wire.valid_id(bad)
    with pytest.raises(ProtocolError, match=re.escape(wire.ID_RULE)):
        wire.check_id(bad, "device id")
    with pytest.raises(BadInput):  # a CLI given one exits 2
        Topics(bad)


def test_the_id_limit_is_inclusive():
    assert wire.check_id("a" * wire.ID_MAX) == "a" * wire.ID_MAX
    assert wire.ID_MAX == 128


@pytest.mark.parametrize("topic", ["edgetune/v2/dev/status", "other/v1/dev/status", "edgetune/v1/dev",
                                   "edgetune/v1//status", "edgetune/v1/dev/", "edgetune/v1/a b/status",
                                   "edgetune/v1/dev/cmd/res/", "edgetune/v1/dev/cmd/res/a/b",
                                   f"edgetune/v1/{'d' * 129}/status"])
def test_topics_outside_the_tree_or_with_bad_ids_do_not_parse(topic):
    with pytest.raises(ProtocolError):
        parse_topic(topic)


def test_filters_for_every_device_one_device_and_a_shared_group():
    assert topic_filter() == "edgetune/v1/+/#"
    assert topic_filter("status", "dev-1") == "edgetune/v1/dev-1/status"
    assert topic_filter("tuning/record", share="fleet") == "$share/fleet/edgetune/v1/+/tuning/record"
    for bad in ("", "a/b", "g+"):
        with pytest.raises(ProtocolError, match="share group"):
            topic_filter(share=bad)
    with pytest.raises(ProtocolError):
        topic_filter(device="a/b")


def test_terminal_and_open_states_split_the_command_states():
    assert set(wire.TERMINAL_STATES) | set(wire.OPEN_STATES) == set(wire.COMMAND_STATES)
    assert not set(wire.TERMINAL_STATES) & set(wire.OPEN_STATES)
    assert wire.OPEN_STATES == ("accepted", "in_progress")


# ---- payloads ----------------------------------------------------------------------------------------------------

def test_encode_is_strict_json_and_decode_reads_it_back():
    raw = wire.encode({"cv": float("nan"), "ms": [1.5, float("inf")], "n": 3, "t": ("a",)})
    assert json.loads(raw) == {"cv": None, "ms": [1.5, None], "n": 3, "t": ["a"]}
    assert b" " not in raw
    assert wire.decode(raw, "x") == {"cv": None, "ms": [1.5, None], "n": 3, "t": ["a"]}


@pytest.mark.parametrize("payload, why", [
    (b"\xff\xfe", "not JSON: the payload is not UTF-8"),
    (b"{nope", "not JSON"),
    (b"[" * 100000, "not JSON"),
    (b"[1, 2]", "not a JSON object (a JSON list)"),
    (b'{"pad": "' + b"x" * 100 + b'"}', "oversized: 111 bytes, the limit is 64"),
])
def test_decode_says_what_is_wrong(payload, why):
    with pytest.raises(ProtocolError, match=re.escape(f"status: {why}")):
        wire.decode(payload, "status", limit=64 if b"pad" in payload else wire.MAX_PAYLOAD_BYTES)


# ---- docs/protocol.md against the module -------------------------------------------------------------------------

def doc_tables() -> dict[str, list[dict[str, str]]]:
    """Every markdown table of the document, by its first column's header: rows as {header: cell}."""
    tables: dict[str, list[dict[str, str]]] = {}
    lines = DOC.read_text().splitlines()
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and line.startswith("|") and re.fullmatch(r"\|(\s*-+\s*\|)+", lines[i + 1]):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")))))
            tables[header[0]] = rows
    return tables


def names(cell: str) -> list[str]:
    """The `code` spans of a cell, in order."""
    return re.findall(r"`([^`]+)`", cell)


def test_the_doc_lists_every_topic_with_direction_qos_retain_and_fields():
    rows = doc_tables()["topic"]
    documented = {names(r["topic"])[0]: r for r in rows}
    assert list(documented) == [t.sub for t in wire.TOPICS]
    for spec in wire.TOPICS:
        r = documented[spec.sub]
        assert r["direction"] == spec.direction, spec.sub
        assert r["QoS"] == str(wire.QOS), spec.sub
        assert r["retained"] == ("yes" if spec.retained else "no"), spec.sub
        assert names(r["payload fields"]) == list(spec.fields), spec.sub


def test_the_doc_lists_every_op_with_its_args():
    rows = doc_tables()["op"]
    assert {names(r["op"])[0]: names(r["args"]) for r in rows} == {op: list(a) for op, a in wire.OPS.items()}


def test_the_doc_lists_every_command_status_and_which_are_terminal():
    rows = doc_tables()["status"]
    assert [names(r["status"])[0] for r in rows] == list(wire.COMMAND_STATES)
    assert [names(r["status"])[0] for r in rows if r["terminal"] == "yes"] == list(wire.TERMINAL_STATES)
    assert {r["terminal"] for r in rows} == {"yes", "no"}


def test_the_doc_lists_every_device_state():
    assert [names(r["state"])[0] for r in doc_tables()["state"]] == list(wire.STATUS_STATES)


def test_the_doc_lists_every_model_state_and_which_are_final():
    rows = doc_tables()["model state"]
    assert [names(r["model state"])[0] for r in rows] == list(wire.MODEL_STATES)
    assert [names(r["model state"])[0] for r in rows if r["final"] == "yes"] == list(wire.MODEL_FINAL_STATES)


def test_the_doc_names_every_release_rejection_reason():
    from edgetune import release

    codes = [v for k, v in vars(release).items() if k.isupper() and isinstance(v, str) and k not in
             ("PROMPT_FORMAT",)]
    text = DOC.read_text()
    assert codes and all(f"`{c}`" in text for c in codes), codes


def test_the_doc_states_the_id_rule_the_prefix_and_the_size_limits():
    text = DOC.read_text()
    assert wire.ID_RULE.replace("A-Z a-z 0-9 _ . : -", "`A-Z a-z 0-9 _ . : -`") in text
    assert f"`{wire.ID_RE.pattern}`" in text
    assert f"`{wire.PREFIX}/{{device_id}}/`" in text and f"`{wire.INVALID_ID}`" in text
    assert f"{wire.MAX_PAYLOAD_BYTES} bytes" in text and f"{wire.MAX_COMMAND_BYTES} bytes" in text
