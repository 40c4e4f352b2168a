import json
import math

import pytest

from specctl.controller import wire

STEP = {"kind": "step", "schema": 1, "server": "sglang-0", "rank": 0, "iter": 18234,
        "ts": 1764441600.125, "batch_size": 4,
        "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
        "accepted": [3, 1, 0, 2], "step_ms": 11.8, "ctx_tokens": 51234}
POLICY = {"kind": "policy", "schema": 1, "version": 7, "created_at": 1764441600.0, "source": "online",
          "table": [{"min_batch": 1, "max_batch": 6, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
                    {"min_batch": 7, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
          "model": {"samples": 10}}


def _with(base, **kw):
    d = json.loads(json.dumps(base))
    for k, v in kw.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d).encode()


_DROP = object()


def test_design_examples_round_trip():
    step = wire.decode(json.dumps(STEP).encode())
    assert isinstance(step, wire.StepRecord)
    assert json.loads(wire.encode(step)) == STEP
    pol = wire.decode(json.dumps(POLICY).encode())
    assert isinstance(pol, wire.PolicyRecord)
    obj = json.loads(wire.encode(pol))
    expect = json.loads(json.dumps(POLICY))
    expect["table"][1].pop("max_batch")  # null is omitted on the wire and means open-ended
    assert obj == expect
    assert wire.decode(wire.encode(pol)) == pol


def test_a_policy_with_exploring_rows_round_trips_and_old_challenge_rows_are_ignored():
    rows = [{"min_batch": 8, "max_batch": 15, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}]
    frame = _with(POLICY, explore=rows, explore_period=64, challenge=rows, challenge_period=16)
    pol = wire.decode(frame)
    assert pol.challenge_period == 16 and pol.challenge[0].config.key == (1, 1, 2)
    assert wire.decode(wire.encode(pol)) == pol
    assert [c.key for c in pol.configs()] == [(3, 1, 4), (0, 1, 1), (1, 1, 2)]
    # the engines' table reads the exploring rows back; challenge rows (older daemons) are ignored
    from specctl.policies.table import PolicyTable
    t = PolicyTable.from_policy_obj(wire.to_obj(pol))
    assert [r.config for r in t.explore] == [(1, 1, 2)] and not hasattr(t, "challenge")


def test_plain_decode_step_may_omit_accepted():
    rec = wire.decode(_with(STEP, config={"steps": 0, "topk": 1, "draft_tokens": 1}, accepted=_DROP))
    assert rec.config.is_off and rec.accepted is None


def test_hot_path_encoder_matches_model_encoder():
    rec = wire.decode(json.dumps(STEP).encode())
    fast = wire.encode_step_fields(server="sglang-0", rank=0, iter=18234, ts=1764441600.125, batch_size=4,
                                   steps=3, topk=1, draft_tokens=4, accepted=[3, 1, 0, 2], step_ms=11.8,
                                   ctx_tokens=51234)
    assert fast == wire.encode(rec)
    off = wire.encode_step_fields(server='we"ird\u00e9', rank=1, iter=1, ts=2.0, batch_size=2, steps=0,
                                  topk=1, draft_tokens=1, accepted=None, step_ms=3.0)
    assert wire.decode(off).server == 'we"ird\u00e9'


@pytest.mark.parametrize("frame, reason, needle", [
    (b"\x00\xff garbage", "bad_json", "JSON"),
    (b'{"kind":"step"', "bad_json", "JSON"),
    (_with(STEP, schema=2), "bad_schema_version", "schema version 2"),
    (_with(STEP, kind="telemetry"), "bad_kind", "telemetry"),
    (_with(STEP, extra=1), "unknown_field", "extra"),
    (_with(STEP, server=_DROP), "missing_field", "server"),
    (_with(STEP, batch_size=-3), "bad_value", "batch_size"),
    (_with(STEP, batch_size=0), "bad_value", "batch_size"),
    (_with(STEP, accepted=[4, 0, 0, 0]), "bad_value", "only steps=3"),
    (_with(STEP, accepted=[1, 1]), "bad_value", "2 entries for batch_size 4"),
    (_with(STEP, accepted=[1, -1, 0, 0]), "bad_value", "accepted"),
    (_with(STEP, accepted=_DROP), "bad_value", "accepted is required"),
    (_with(STEP, step_ms=-1.0), "bad_value", "step_ms"),
    (b'{"kind":"step","schema":1,"server":"a","rank":0,"iter":1,"ts":1,"batch_size":1,'
     b'"config":{"steps":0,"topk":1,"draft_tokens":1},"step_ms":NaN}', "bad_value", "step_ms"),
    (b'{"kind":"step","schema":1,"server":"a","rank":0,"iter":1,"ts":1,"batch_size":1,'
     b'"config":{"steps":0,"topk":1,"draft_tokens":1},"step_ms":Infinity}', "bad_value", "step_ms"),
    (_with(STEP, step_ms="fast"), "bad_value", "step_ms"),
    (_with(STEP, config={"steps": 3, "topk": 1, "draft_tokens": 9}), "bad_value", "draft_tokens"),
    (_with(STEP, config={"steps": 0, "topk": 4, "draft_tokens": 1}), "bad_value", "steps=0"),
    (_with(STEP, batch_size=70000, accepted=[0] * 70000), "bad_value", "batch_size"),
    (_with(POLICY, table=[]), "bad_value", "table"),
    (_with(POLICY, table=[{"min_batch": 2, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]),
     "bad_value", "expected 1"),
    (_with(POLICY, table=[{"min_batch": 1, "max_batch": 4, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]),
     "bad_value", "open-ended"),
    (_with(POLICY, table=[{"min_batch": 1, "max_batch": 4, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}},
                          {"min_batch": 6, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]),
     "bad_value", "expected 5"),
    (_with(POLICY, source="guess"), "bad_value", "source"),
    (_with(POLICY, explore_period=10), "bad_value", "explore_period"),
    (_with(POLICY, challenge_period=4), "bad_value", "challenge_period"),
    (b"x" * (wire.MAX_FRAME_BYTES + 1), "too_large", "exceeds"),
])
def test_rejections_name_the_problem(frame, reason, needle):
    with pytest.raises(wire.WireError) as ei:
        wire.decode(frame)
    assert ei.value.reason == reason
    assert needle in str(ei.value)


@pytest.mark.parametrize("text, key", [
    ("3,1,4", (3, 1, 4)), ("off", (0, 1, 1)), ("s2", (2, 1, 3)), ("s2k4n16", (2, 4, 16)), ("0,1,1", (0, 1, 1)),
])
def test_parse_config(text, key):
    assert wire.parse_config(text).key == key


@pytest.mark.parametrize("text", ["3,1,9", "banana", "s", "-1,1,1", "2,0,3"])
def test_parse_config_rejects(text):
    with pytest.raises(ValueError, match="invalid configuration"):
        wire.parse_config(text)


def test_config_names():
    assert [wire.parse_config(t).name for t in ("off", "s1", "2,4,16")] == ["off", "s1", "s2k4n16"]
    assert math.isfinite(wire.decode(json.dumps(STEP).encode()).step_ms)


def test_telemetry_decoder_requires_a_step_kind():
    no_kind = json.loads(json.dumps(STEP))
    no_kind.pop("kind")
    with pytest.raises(wire.WireError) as ei:
        wire.decode_step(json.dumps(no_kind).encode())
    assert ei.value.reason == "bad_kind"
    with pytest.raises(wire.WireError) as ei:
        wire.decode_step(json.dumps(POLICY).encode())
    assert ei.value.reason == "wrong_kind"


# ------------------------------------------------------------------------- context bands

S3_OBJ, OFF_OBJ = {"steps": 3, "topk": 1, "draft_tokens": 4}, {"steps": 0, "topk": 1, "draft_tokens": 1}


def _band(lo, hi, cut):
    rows = [{"min_batch": 1, "max_batch": cut, "config": S3_OBJ}, {"min_batch": cut + 1, "config": OFF_OBJ}]
    for r in rows:
        if lo is not None:
            r["min_ctx"] = lo
        if hi is not None:
            r["max_ctx"] = hi
    return rows


def test_a_banded_policy_round_trips_and_the_engine_table_reads_it():
    table = POLICY["table"] + _band(0, 1023, 60) + _band(1024, None, 12)
    pol = wire.decode(_with(POLICY, table=table))
    assert [r.ctx_band for r in pol.table] == [None, None, (0, 1023), (0, 1023), (1024, None), (1024, None)]
    assert wire.decode(wire.encode(pol)) == pol
    from specctl.policies.table import PolicyTable
    t = PolicyTable.from_policy_obj(wire.to_obj(pol))
    assert (t.lookup(30), t.lookup(30, 30 * 500), t.lookup(30, 30 * 5000)) == ((0, 1, 1), (3, 1, 4), (0, 1, 1))
    assert t.to_rows_obj() == [dict(r, max_batch=r.get("max_batch")) for r in table]


@pytest.mark.parametrize("table, needle", [
    (_band(0, None, 5), "rows naming no context"),                                  # bands only
    (POLICY["table"] + [_band(0, 99, 5)[0]], "open-ended (max_batch null) (context band 0-99)"),
    (POLICY["table"] + _band(0, 99, 5)[:1] + [dict(_band(0, 99, 5)[1], min_batch=7)], "expected 6 (no gaps, no overlap) (context band 0-99)"),
    (POLICY["table"] + _band(100, None, 5) + _band(0, 99, 5), "precedes"),
    (POLICY["table"] + _band(0, 100, 5) + _band(100, None, 5), "overlaps"),
    (_band(0, 99, 5)[:1] + POLICY["table"] + _band(0, 99, 5)[1:], "not consecutive"),
    (POLICY["table"][:1] + _band(0, 99, 5) + POLICY["table"][1:], "naming no context are not consecutive"),
    ([dict(POLICY["table"][0], min_ctx=50, max_ctx=10)] + POLICY["table"][1:], "max_ctx 10 < min_ctx 50"),
    ([dict(POLICY["table"][0], min_ctx=-1)] + POLICY["table"][1:], "min_ctx"),
])
def test_bad_bands_are_refused_with_the_reason(table, needle):
    with pytest.raises(wire.WireError) as ei:
        wire.decode(_with(POLICY, table=table))
    assert ei.value.reason == "bad_value" and needle in str(ei.value), str(ei.value)


def test_exploring_rows_may_name_a_context_band():
    row = dict(POLICY["table"][0], min_ctx=4096)
    pol = wire.decode(_with(POLICY, explore=[row], explore_period=64))
    assert pol.explore[0].ctx_band == (4096, None) and wire.decode(wire.encode(pol)) == pol
    from specctl.policies.table import PolicyTable
    t = PolicyTable.from_policy_obj(wire.to_obj(pol))
    assert t.explore[0].min_ctx == 4096 and t.to_rows_obj() == PolicyTable(rows=t.rows).to_rows_obj()


def test_records_without_context_fields_parse_as_before():
    assert wire.decode(_with(STEP, ctx_tokens=_DROP)).ctx_tokens is None
    pol = wire.decode(json.dumps(POLICY).encode())
    assert all(r.ctx_band is None for r in pol.table)
    assert "ctx" not in wire.encode(pol).decode()  # nothing new is written for a table without bands
