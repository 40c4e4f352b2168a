"""EngineController without SGLang: decisions, policy intake, TP-style apply, fallbacks, telemetry."""

from __future__ import annotations

import dataclasses

import json

import pytest

from specctl.controller import wire
from specctl.plugin.engine import EngineController, PluginSettings, PolicyUpdate
from specctl.policies.table import PolicyTable


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def policy_frame(version: int, rows, *, explore=None, explore_period=None, source="online",
                 challenge=None, challenge_period=None) -> bytes:
    obj = {"kind": "policy", "schema": 1, "version": version, "created_at": 1.0, "source": source,
           "table": [{"min_batch": a, "max_batch": b,
                      "config": {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1}}
                     for a, b, s in rows]}
    if explore:
        obj["explore"] = [{"min_batch": a, "max_batch": b,
                           "config": {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1}}
                          for a, b, s in explore]
        obj["explore_period"] = explore_period
    if challenge:
        obj["challenge"] = [{"min_batch": a, "max_batch": b,
                             "config": {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1}}
                            for a, b, s in challenge]
        obj["challenge_period"] = challenge_period
    return json.dumps(obj).encode()


def make(clock=None, candidates=(0, 1, 3), states=None, **kw) -> EngineController:
    s = PluginSettings(**{"stale_after_s": 10.0, "sync_every": 4, "policy_endpoint": "ipc:///x", **kw})
    return EngineController(s, candidate_steps=candidates, states=states, clock=clock or Clock())


def run_results(eng: EngineController, n: int) -> None:
    """n decode results; sync at each boundary as a single rank would."""
    for _ in range(n):
        if eng.note_result():
            eng.sync()


def test_starts_on_fixed_threshold_fallback_with_reason():
    eng = make()
    assert eng.active_source == "fallback"
    assert "no policy received yet" in eng.fallback_reason
    assert [eng.decide(b) for b in (1, 4, 5, 64)] == [3, 3, 0, 0]


def test_policy_applies_only_at_a_sync_boundary_then_drives_decisions():
    eng = make()
    assert eng.offer_policy_frame(policy_frame(7, [(1, 8, 1), (9, None, 0)])) is None
    assert eng.decide(4) == 3  # staged, not yet applied
    run_results(eng, 3)
    assert eng.active_source == "fallback"
    run_results(eng, 1)
    assert (eng.active_source, eng.active_version, eng.fallback_reason) == ("online", 7, None)
    assert [eng.decide(b) for b in (1, 8, 9, 200)] == [1, 1, 0, 0]


def test_policy_naming_a_step_without_runtime_state_falls_back():
    eng = make()
    eng.offer_policy_frame(policy_frame(3, [(1, 4, 7), (5, None, 0)]))
    run_results(eng, 4)
    assert eng.active_source == "fallback"
    assert "steps=7" in eng.fallback_reason and "no runtime state" in eng.fallback_reason
    assert eng.decide(2) == 3


def test_stale_policy_falls_back_and_a_heartbeat_restores_it():
    clock = Clock()
    eng = make(clock)
    frame = policy_frame(2, [(1, None, 1)])
    eng.offer_policy_frame(frame)
    run_results(eng, 4)
    assert eng.decide(50) == 1
    clock.t += 9.9
    run_results(eng, 4)
    assert eng.active_source == "online"  # not before the timeout (10 s)
    clock.t += 0.6
    run_results(eng, 3)
    assert eng.active_source == "online"  # past it, but only a sync boundary changes the table
    run_results(eng, 1)  # the first boundary after the timeout
    assert eng.active_source == "fallback" and "stale" in eng.fallback_reason
    assert eng.decide(50) == 0
    eng.offer_policy_frame(frame)  # the daemon is back, same policy re-sent
    run_results(eng, 4)
    assert (eng.active_source, eng.active_version) == ("online", 2)
    assert eng.decide(50) == 1


def test_no_daemon_is_reported_after_the_timeout():
    clock = Clock()
    eng = make(clock)
    clock.t += 11
    run_results(eng, 4)
    assert eng.active_source == "fallback" and eng.fallback_reason.startswith("no daemon")


def test_malformed_frame_is_rejected_and_the_policy_in_force_kept():
    eng = make()
    eng.offer_policy_frame(policy_frame(1, [(1, None, 1)]))
    run_results(eng, 4)
    assert eng.offer_policy_frame(b'{"kind":"policy","schema":9}') in ("bad_schema_version", "missing_field")
    run_results(eng, 4)
    assert (eng.active_source, eng.active_version) == ("online", 1)
    assert eng.stats.num_frames_rejected == 1


def test_exploration_rows_follow_the_step_counter():
    eng = make()
    eng.offer_policy_frame(policy_frame(1, [(1, None, 0)], explore=[(1, 16, 1), (1, 16, 3)],
                                        explore_period=50))
    run_results(eng, 4)
    got = [eng.decide(8) for _ in range(151)]
    assert got[0] == 1 and got[50] == 3 and got[100] == 1
    assert set(got[1:50]) == {0}


def test_challenge_rows_of_an_older_daemon_are_accepted_and_ignored():
    eng = make(candidates=(0, 3))  # no state for the challenger's steps=1: ignored rows are not checked either
    eng.offer_policy_frame(policy_frame(1, [(1, None, 0)], explore=[(1, 16, 3)], explore_period=50,
                                        challenge=[(1, 16, 1)], challenge_period=16))
    run_results(eng, 4)
    assert eng.active_source == "online" and eng.active_version == 1
    got = [eng.decide(8) for _ in range(101)]
    assert (got[0], got[50], got[100]) == (3, 3, 3) and set(got) == {0, 3} and got.count(3) == 3


def test_internal_error_falls_back_for_good():
    eng = make()
    eng.offer_policy_frame(policy_frame(1, [(1, None, 1)]))
    run_results(eng, 4)

    class Broken(PolicyTable):
        def decide(self, batch_size, step_counter, ctx_tokens=None):
            raise ZeroDivisionError("boom")

    object.__setattr__(eng, "table", Broken(rows=eng.table.rows))
    assert eng.decide(2) == 3  # the fallback's answer
    assert eng.failed and "ZeroDivisionError" in eng.failed
    eng.offer_policy_frame(policy_frame(2, [(1, None, 1)]))
    run_results(eng, 8)
    assert eng.active_source == "fallback" and eng.decide(2) == 3


def test_tp_ranks_apply_the_same_update_at_the_same_step():
    """Two engines, rank 0 and rank 1, with a broadcast that hands rank 0's object to both."""
    r0 = make()
    r1 = EngineController(r0.settings, candidate_steps=(0, 1, 3), clock=Clock(), rank=1)
    sizes = [(i * 7) % 13 + 1 for i in range(400)]
    got0, got1 = [], []
    for i, bs in enumerate(sizes):
        if i == 37:
            r0.offer_policy_frame(policy_frame(1, [(1, 6, 1), (7, None, 3)]))
        if i == 211:
            r1.offer_policy_frame(policy_frame(9, [(1, None, 0)]))  # rank 1 never listens: ignored
            r0.offer_policy_frame(policy_frame(2, [(1, None, 3)]))
        got0.append(r0.decide(bs))
        got1.append(r1.decide(bs))
        b0, b1 = r0.note_result(), r1.note_result()
        assert b0 == b1
        if b0:
            upd = r0.take_pending()
            r0.sync(lambda _: upd)
            r1.sync(lambda _: upd)
    assert got0 == got1
    assert r0.active_version == r1.active_version == 2
    assert {3, 1, 0} <= set(got0)


def test_step_record_is_exactly_the_wire_encoding():
    eng = EngineController(PluginSettings(server_id='srv "7"'), candidate_steps=(0, 3), rank=2)
    cases = [
        dict(iter=18234, ts=1764441600.125, batch_size=4, draft_tokens=4, accepted=[3, 1, 0, 2], step_ms=11.8),
        dict(iter=1, ts=1764441600.0, batch_size=2, draft_tokens=1, accepted=[0, 0], step_ms=6.25),
        dict(iter=5, ts=1764441601.5, batch_size=1, draft_tokens=4, accepted=[3], step_ms=9.0, ctx_tokens=512),
        dict(iter=6, ts=1764441601.5, batch_size=3, draft_tokens=1, accepted=None, step_ms=6.0, off_path="decode"),
        dict(iter=7, ts=1764441601.5, batch_size=3, draft_tokens=1, accepted=None, step_ms=6.0, ctx_tokens=900,
             off_path="verify"),
        # a speculating step says no off path, whatever the caller passed
        dict(iter=8, ts=1764441601.5, batch_size=1, draft_tokens=4, accepted=[1], step_ms=9.0, off_path="decode"),
    ]
    for c in cases:
        frame = eng.step_record(**c)
        rec = wire.decode_step(frame)
        assert rec.off_path == (c.get("off_path") if c["draft_tokens"] == 1 else None)
        assert frame == wire.encode(rec)
        assert rec.config.steps == c["draft_tokens"] - 1 if c["draft_tokens"] > 1 else rec.config.steps == 0
        assert rec.rank == 2 and rec.server == 'srv "7"'
        # one encoder: the engine's frame is wire.encode_step_fields' for the same fields
        c0 = rec.config
        assert frame == wire.encode_step_fields(server='srv "7"', rank=2, iter=c["iter"], ts=c["ts"],
                                                batch_size=c["batch_size"], steps=c0.steps, topk=c0.topk,
                                                draft_tokens=c0.draft_tokens, accepted=rec.accepted,
                                                step_ms=c["step_ms"], ctx_tokens=c.get("ctx_tokens"),
                                                off_path=rec.off_path)


@pytest.mark.parametrize("accepted", [[0], [7, 30, 12], [64, 10], [10] * 5, [3, 0, 2]])
def test_the_step_encoder_matches_the_model_encoder_for_any_count(accepted):
    frame = wire.encode_step_fields(server="s", rank=0, iter=1, ts=2.0, batch_size=max(1, len(accepted)), steps=64,
                                    topk=1, draft_tokens=65, accepted=accepted, step_ms=5.0)
    assert frame == wire.encode(wire.decode_step(frame))


def test_file_mode_starts_on_the_file_policy():
    frame = policy_frame(4, [(1, 2, 3), (3, None, 1)], source="file")
    s = PluginSettings(mode="file", policy_file="/p.json")
    eng = EngineController(s, candidate_steps=(0, 1, 3), initial_policy=frame)
    assert (eng.active_source, eng.active_version) == ("file", 4)
    assert [eng.decide(b) for b in (1, 2, 3)] == [3, 3, 1]
    assert eng.take_pending() is None


def test_fallback_adapts_to_the_built_states():
    eng = make(candidates=(0, 1, 2))  # no steps=3 state: speculate with 2 below the threshold
    assert [eng.decide(b) for b in (1, 5)] == [2, 0]
    eng = make(candidates=(1, 3, 7))  # no "off" state (0.5.17's default "1" slot)
    assert [eng.decide(b) for b in (1, 5, 100)] == [3, 3, 3]


def test_settings_from_env():
    s = PluginSettings.from_env({"SPECCTL_RUNDIR": "/run/x", "SPECCTL_FALLBACK": "9:s1", "SPECCTL_TELEMETRY": "none",
                                 "SPECCTL_STALE_AFTER_S": "3.5", "SPECCTL_SERVER_ID": "a"})
    assert s.policy_endpoint == "ipc:///run/x/policy.sock" and s.telemetry_endpoint is None
    assert (s.fallback_config, s.fallback_threshold, s.stale_after_s, s.server_id) == ((1, 1, 2), 9, 3.5, "a")
    assert PluginSettings.from_env({"SPECCTL_POLICY_FILE": "/p"}).mode == "file"
    with pytest.raises(ValueError, match="SPECCTL_MODE"):
        PluginSettings.from_env({"SPECCTL_MODE": "magic"})
    with pytest.raises(ValueError, match="SPECCTL_STALE_AFTER_S"):
        PluginSettings.from_env({"SPECCTL_STALE_AFTER_S": "x"})


def test_apply_of_an_explicit_fallback_update():
    eng = make()
    eng.apply(PolicyUpdate(PolicyTable.from_rows([(1, None, (1, 1, 2))], source="online", version=5)))
    assert eng.decide(100) == 1
    eng.apply(PolicyUpdate(None, "operator said so"))
    assert eng.decide(100) == 0 and eng.fallback_reason == "operator said so"


def test_step_record_accepted_lists_of_every_shape():
    eng = EngineController(PluginSettings(), candidate_steps=(0, 12))
    for acc in ([], [0], [9, 0, 9], [12, 3, 10], [i % 13 for i in range(300)]):
        frame = eng.step_record(iter=3, ts=2.5, batch_size=max(1, len(acc)), draft_tokens=13,
                                accepted=acc or None, step_ms=1.5)
        assert json.loads(frame).get("accepted") == (acc or None)
        if acc:
            assert frame == wire.encode(wire.decode_step(frame))


def test_without_a_tp_group_every_rank_runs_the_fixed_fallback():
    # a process that cannot learn its TP rank must not listen to the daemon as if it were rank 0
    from specctl.plugin.sglang_hooks import PluginRuntime

    def no_group():
        raise RuntimeError("parallel state not initialised")

    rt = PluginRuntime(PluginSettings(mode="online", policy_endpoint="ipc:///nonexistent/p.sock"),
                       tp_group_fn=no_group)
    eng = rt.new_engine([0, 1, 3])
    assert eng.failed and "no TP group" in eng.failed
    assert rt.receiver is None and rt.sync_on is False
    assert [eng.decide(b) for b in (1, 4, 5, 64)] == [3, 3, 0, 0]


def test_decision_log_records_every_decision_per_rank(tmp_path):
    """SPECCTL_DECISION_LOG: one line per decision (step, batch size, steps, version or F), per rank;
    what the 2-GPU run compares between ranks."""
    s = dataclasses.replace(PluginSettings.from_env({"SPECCTL_DECISION_LOG": str(tmp_path / "d{rank}.txt"),
                                                     "SPECCTL_POLICY": "ipc:///x"}), sync_every=4)
    r0 = EngineController(s, candidate_steps=(0, 1, 3), clock=Clock(), rank=0)
    r1 = EngineController(s, candidate_steps=(0, 1, 3), clock=Clock(), rank=1)
    for i, bs in enumerate([1, 2, 8, 8, 1, 9, 2, 3]):
        if i == 1:
            r0.offer_policy_frame(policy_frame(5, [(1, 2, 1), (3, None, 0)]))
        r0.decide(bs)
        r1.decide(bs)
        if r0.note_result() & r1.note_result():
            upd = r0.take_pending()
            r0.sync(lambda _: upd)
            r1.sync(lambda _: upd)
    r0.close_trace()
    r1.close_trace()
    lines = [(tmp_path / f"d{r}.txt").read_text().splitlines() for r in (0, 1)]
    assert lines[0][0].startswith("# specctl decisions rank 0") and lines[1][0].startswith("# specctl decisions rank 1")
    assert lines[0][1:] == lines[1][1:]
    assert lines[0][1:] == ["0 1 3 F", "1 2 3 F", "2 8 0 F", "3 8 0 F", "4 1 1 5", "5 9 0 5", "6 2 1 5", "7 3 0 5"]


def test_decision_log_that_cannot_be_opened_is_reported_not_fatal(tmp_path, caplog):
    s = PluginSettings(decision_log=str(tmp_path / "missing-dir" / "d{rank}.txt"), mode="fixed")
    eng = EngineController(s, candidate_steps=(0, 3))
    assert [eng.decide(b) for b in (1, 5)] == [3, 0]
    assert any("no decision log" in r.getMessage() for r in caplog.records)


TREE = (2, 4, 16)


def tree_frame(version: int, rows) -> bytes:
    """rows: (min, max, config triple)."""
    obj = {"kind": "policy", "schema": 1, "version": version, "created_at": 1.0, "source": "online",
           "table": [{"min_batch": a, "max_batch": b,
                      "config": {"steps": c[0], "topk": c[1], "draft_tokens": c[2]}} for a, b, c in rows]}
    return json.dumps(obj).encode()


def test_a_tree_state_is_chosen_by_its_key_and_a_chain_under_that_key_is_refused():
    eng = make(candidates=(0, 1, 2, 3), states={2: TREE})
    eng.offer_policy_frame(tree_frame(3, [(1, 4, TREE), (5, None, (0, 1, 1))]))
    run_results(eng, 4)
    assert (eng.active_source, eng.active_version) == ("online", 3)
    assert [eng.decide(b) for b in (1, 4, 5)] == [2, 2, 0]  # SGLang's key of the tree state
    # a chain s2 has no state here (key 2 runs the tree): refused, the fallback takes over
    eng.offer_policy_frame(tree_frame(4, [(1, None, (2, 1, 3))]))
    run_results(eng, 4)
    assert eng.active_source == "fallback"
    assert "names s2, but the runtime state for steps=2 runs s2k4n16" in eng.fallback_reason
    # and on a chain-only server the tree is refused the same way
    chains = make(candidates=(0, 1, 2, 3))
    chains.offer_policy_frame(tree_frame(5, [(1, None, TREE)]))
    run_results(chains, 4)
    assert "names s2k4n16, but the runtime state for steps=2 runs s2" in chains.fallback_reason


def test_telemetry_names_the_tree_by_its_width():
    eng = make(candidates=(0, 2, 3), states={2: TREE})
    for width, want in [(16, TREE), (4, (3, 1, 4)), (1, (0, 1, 1))]:
        rec = wire.decode_step(eng.step_record(iter=1, ts=1.0, batch_size=2, draft_tokens=width,
                                               accepted=[2, 0] if width > 1 else None, step_ms=9.0))
        assert rec.config.key == want


def test_the_fallback_may_be_the_tree():
    eng = make(candidates=(0, 1, 2), states={2: TREE}, fallback_config=TREE)
    assert [eng.decide(b) for b in (1, 4, 5, 64)] == [2, 2, 0, 0]
    # a tree fallback with no tree state: the nearest chain below it
    eng = make(candidates=(0, 1, 2), fallback_config=(2, 4, 16))
    assert [eng.decide(b) for b in (1, 5)] == [2, 0] and eng.states[2] == (2, 1, 3)


@pytest.mark.parametrize("states, why", [
    ({2: (3, 4, 16)}, "does not run 2 steps"),
    ({0: (0, 4, 16)}, "plain decode"),
    ({5: (5, 1, 6)}, "did not build"),
    ({2: (2, 4, 4)}, "both verify 4 tokens"),
])
def test_inconsistent_states_are_named(states, why):
    with pytest.raises(ValueError, match=why):
        make(candidates=(0, 2, 3), states=states)


def test_a_tree_that_could_not_be_built_stops_being_offered():
    eng = make(candidates=(0, 1, 2), states={2: TREE}, fallback_config=TREE)
    eng.offer_policy_frame(tree_frame(3, [(1, None, TREE)]))
    run_results(eng, 4)
    assert eng.decide(1) == 2
    eng.replace_state(2, (2, 1, 3), "out of memory")
    assert eng.active_source == "fallback" and "runs s2" in eng.fallback_reason
    assert eng.states[2] == (2, 1, 3)
    assert [eng.decide(b) for b in (1, 5)] == [2, 0]  # the fallback's tree became the chain s2
    rec = wire.decode_step(eng.step_record(iter=1, ts=1.0, batch_size=1, draft_tokens=3, accepted=[1], step_ms=8.0))
    assert rec.config.key == (2, 1, 3)


def _banded_frame(version: int) -> bytes:
    obj = json.loads(policy_frame(version, [(1, 4, 3), (5, None, 0)]))
    for lo, hi, rows in ((0, 1023, [(1, 9, 3), (10, None, 0)]), (1024, None, [(1, 3, 1), (4, None, 0)])):
        for a, b, s in rows:
            r = {"min_batch": a, "max_batch": b, "config": {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1},
                 "min_ctx": lo}
            if hi is not None:
                r["max_ctx"] = hi
            obj["table"].append(r)
    return json.dumps(obj).encode()


@pytest.mark.parametrize("batch, ctx_tokens, steps", [
    (6, None, 0),          # context unknown: the rows naming none
    (6, 6 * 300, 3),       # ~300 tokens a request: the first band
    (6, 6 * 6000, 0), (3, 3 * 6000, 1),
    (12, 12 * 1023, 0), (9, 9 * 1023, 3), (9, 9 * 1024, 0),
])
def test_a_banded_policy_decides_by_the_batch_context(batch, ctx_tokens, steps):
    eng = make()
    eng.offer_policy_frame(_banded_frame(3))
    run_results(eng, 4)
    assert eng.active_version == 3
    assert eng.decide(batch, ctx_tokens) == steps


def test_the_decision_log_carries_the_context_where_it_was_known(tmp_path):
    s = dataclasses.replace(PluginSettings.from_env({"SPECCTL_DECISION_LOG": str(tmp_path / "d{rank}.txt"),
                                                     "SPECCTL_POLICY": "ipc:///x"}), sync_every=1)
    eng = EngineController(s, candidate_steps=(0, 1, 3), clock=Clock())
    eng.offer_policy_frame(_banded_frame(7))
    eng.note_result() and eng.sync()
    eng.decide(6, 6 * 6000)
    eng.decide(6)
    eng.close_trace()
    assert (tmp_path / "d0.txt").read_text().splitlines()[1:] == ["0 6 0 7 36000", "1 6 0 7"]
