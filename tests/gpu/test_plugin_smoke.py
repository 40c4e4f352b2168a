"""CPU tests of benchmarks/gpu/plugin_smoke.py: the policy it loads, the site layout, the summaries."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import plugin_smoke as S  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_policy_is_a_valid_wire_policy_and_matches_the_table():
    from specctl.controller import wire
    from specctl.plugin.engine import EngineController, PluginSettings

    frame = json.dumps(S.policy_obj()).encode()
    wire.decode_policy(frame)
    eng = EngineController(PluginSettings(mode="file", policy_file="x"), candidate_steps=[0, 1, 3],
                           initial_policy=frame)
    assert eng.active_source == "file"
    for bs in (1, 2, 3, 4, 8, 64):
        assert eng.decide(bs) == S.expected_steps(bs)


def test_adaptive_config_is_what_sglang_args_prints():
    from specctl.plugin import launch_args

    want = launch_args.build([(0, 1, 1), (1, 1, 2), (3, 1, 4)]).adaptive_config
    with open(os.path.join(REPO, "benchmarks", "gpu", "plugin_smoke_adaptive.json")) as f:
        assert json.load(f) == want


def test_site_layout_exposes_the_entry_point(tmp_path):
    import importlib.metadata as md

    S.cmd_site(REPO, str(tmp_path))
    dists = list(md.distributions(path=[str(tmp_path)]))
    assert [d.metadata["Name"] for d in dists] == ["specctl"]
    eps = [e for e in dists[0].entry_points if e.group == "sglang.srt.plugins"]
    assert [(e.name, e.value) for e in eps] == [("specctl", "specctl.plugin:register")]
    assert os.path.realpath(tmp_path / "specctl" / "plugin") == os.path.join(REPO, "plugin")


def _frame(it, bs, steps, ms=2.0, ts=100.0):
    return {"kind": "step", "iter": it, "ts": ts + it * 0.005, "batch_size": bs,
            "config": {"steps": steps, "topk": 1, "draft_tokens": steps + 1},
            "accepted": [steps] * bs if steps else None, "step_ms": ms}


def test_summaries_count_matches_switches_and_first_steps():
    frames = [_frame(0, 1, 3, 900.0), _frame(1, 1, 3), _frame(2, 2, 1, 200.0), _frame(3, 2, 1),
              _frame(4, 8, 3)]
    t = S.summarize_telemetry(frames)
    assert t["config_matches_table"] == 4 and t["config_mismatches"] == 1
    assert [f["iter"] for f in t["first_step_after_switch"]] == [0, 2, 4]
    assert t["cadence_vs_event"]["bs1/s3"]["n"] == 1
    log = S.summarize_log("[x] specctl: all 3 hooks in place\n"
                          "[x] Switch adaptive runtime state: steps 3 -> 1, draft_tokens 4 -> 2\n")
    assert log["hooks_all_in_place"]["count"] == 1 and log["switch_transitions"] == {"3->1": 1}
