"""Tree states (topk > 1) beside chains and plain decode: the plugin's tree hooks, applied by SGLang's
real HookRegistry, around SGLang's real AdaptiveController and AdaptiveSpeculativeParams (our REPLACE)
on the tree stand-ins of sglang_standin.py (the real workers need CUDA). What a GPU adds (graphs,
kernels, memory) is checked by benchmarks/gpu/tree_check.py."""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import pytest
import zmq

from specctl.controller import transport
from specctl.plugin import launch_args, sglang_hooks, sglang_source

pytestmark = pytest.mark.sglang

TREE = (2, 4, 16)
CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 32, 64]
CANDIDATES = [(0, 1, 1), (1, 1, 2), TREE, (3, 1, 4)]


def standin():
    import sys

    return sys.modules["specctl_sglang_standin"]


def accept_tree(forward_iter: int, batch_size: int, steps: int) -> list[int]:
    return [(forward_iter + i) % (steps + 1) for i in range(batch_size)]


def frame(version: int, rows) -> bytes:
    return json.dumps({"kind": "policy", "schema": 1, "version": version, "created_at": 1.0, "source": "online",
                       "table": [{"min_batch": a, "max_batch": b,
                                  "config": {"steps": c[0], "topk": c[1], "draft_tokens": c[2]}}
                                 for a, b, c in rows]}).encode()


@pytest.fixture
def tree_server(plugged, tmp_path, monkeypatch):
    """`specctl sglang-args --configs off,s1,s2k4n16,s3` launched on the tree stand-in."""
    st = standin()
    base = plugged.settings

    def make(candidates=CANDIDATES, *, fail_build=None, **settings_kw):
        plugged.settings = dataclasses.replace(base, **settings_kw)
        args = launch_args.build(candidates, config_path=str(tmp_path / "adaptive.json"))
        (tmp_path / "adaptive.json").write_text(json.dumps(args.adaptive_config))
        steps = int(args.flags[args.flags.index("--speculative-num-steps") + 1])
        rc = st.RuntimeContextStandin(st.ServerArgsStandin(str(tmp_path / "adaptive.json"), steps))
        monkeypatch.setattr(sglang_source, "runtime_context", lambda: rc)
        worker = st.TreeWorkerStandin(steps, str(tmp_path / "adaptive.json"), accept_tree, rc)
        worker.fail_build = fail_build
        worker.init_cuda_graphs(list(CUDA_GRAPH_BS))
        eng = worker.adaptive_controller.params.specctl
        assert eng is not None
        return worker, st.ResultProcessorStandin(worker), eng, rc

    yield make
    plugged.settings = base
    plugged.trees, plugged.max_topk = {}, 1


def publish_until(pub, frame_bytes, worker, proc, eng, version, timeout_s=60.0) -> int:
    """Publish (as the daemon's heartbeat does) while serving until the engine runs `version`."""
    it = 0
    deadline = time.monotonic() + timeout_s
    while eng.active_version != version:
        assert time.monotonic() < deadline, "policy never applied"
        pub.send(frame_bytes)
        time.sleep(0.01)
        it = prefill_then_decode(worker, proc, [1, 4, 2, 7], it)
    return it


def prefill_then_decode(worker, proc, sizes, start_iter):
    st = standin()
    worker.forward_batch_generation(st.Batch(sizes[0], start_iter, extend=True))
    return st.run_decode(worker, proc, sizes, start_iter=start_iter + 1, overlap=True)


def test_the_tree_is_built_under_its_key_with_topk_and_width_everywhere_a_build_reads_them(tree_server):
    worker, proc, eng, rc = tree_server()
    # off, s1 and the tree were built (s3 is the launch state); the sizing slot's 15 was not
    assert sorted(worker.seen_at_build) == [0, 1, 2]
    tree = worker.seen_at_build[2]
    assert tree == dict(draft_tokens=16, worker_topk=4, draft_topk=4, bag_topk=4, server_args=(4, 16))
    assert worker.seen_at_build[1]["worker_topk"] == 1 and worker.seen_at_build[1]["server_args"] == (1, 4)
    # and everything was put back: the server runs its launch chain s3 with topk 1
    assert (worker.topk, worker._draft_worker.topk, rc.bag.speculative_eagle_topk) == (1, 1, 1)
    assert (rc.sa.speculative_eagle_topk, rc.sa.speculative_num_draft_tokens) == (1, 4)
    assert [src for src, _ in rc.sa.mutations] == ["specctl.tree_build", "specctl.tree_build_restore"]
    ctl = worker.adaptive_controller
    assert ctl._states[2].speculative_num_draft_tokens == 16 and ctl._states[2]._specctl_topk == 4
    assert eng.states == {0: (0, 1, 1), 1: (1, 1, 2), 2: TREE, 3: (3, 1, 4)}


def test_switching_every_step_between_off_chains_and_the_tree_keeps_every_width_consistent(tree_server, plugged):
    """A table that changes configuration at almost every step (batch sizes scrambled): every
    draft reads a top-k as wide as its state's topk, every verify runs the state's topk, and the
    draft input relayed between steps keeps one width (the tree's) from the first prefill on."""
    worker, proc, eng, rc = tree_server()
    rows = [(1, 2, (3, 1, 4)), (3, 5, TREE), (6, 8, (1, 1, 2)), (9, None, (0, 1, 1))]
    pub = transport.policy_pub(zmq.Context.instance(), plugged.settings.policy_endpoint)
    st = standin()
    try:
        it = publish_until(pub, frame(21, rows), worker, proc, eng, 21)
    finally:
        pub.close(linger=0)
    first = it
    sizes = [(i * 7) % 13 + 1 for i in range(300)]
    st.run_decode(worker, proc, sizes, start_iter=first, overlap=True)
    want = {b: eng.table.lookup(b) for b in range(1, 14)}
    used = [worker.used[i] for i in range(first, first + len(sizes))]
    assert [s for _, s in used] == [want[b][0] for b, _ in used]
    verified = worker.verified[-len(sizes):]
    assert {(s, k, n) for s, k, n in verified} == {(3, 1, 4), (2, 4, 16), (1, 1, 2), (0, 1, 1)}
    assert worker._draft_worker.relay_width == 4
    assert {k for s, k in worker._draft_worker.drafted} == {1, 4}
    assert rc.bag.speculative_eagle_topk in (1, 4) and eng.active_source == "online"
    n_switch = sum(1 for a, b in zip(used, used[1:]) if a[1] != b[1])
    assert n_switch > 100  # the point: a switch at most steps, in every direction


def test_telemetry_names_tree_steps_by_their_width(tree_server, plugged):
    worker, proc, eng, _ = tree_server()
    rows = [(1, 4, TREE), (5, None, (0, 1, 1))]
    st = standin()
    first, recs = st.telemetry_during(
        plugged.settings, lambda pub: publish_until(pub, frame(22, rows), worker, proc, eng, 22),
        lambda it: st.run_decode(worker, proc, [2], start_iter=it, overlap=False),
        lambda first: st.run_decode(worker, proc, [1, 3, 4, 5, 9] * 10, start_iter=first))
    assert [r.iter for r in recs] == list(range(first, first + 50))  # one frame a step, none lost
    for r in recs:
        bs, steps = worker.used[r.iter]
        assert r.config.key == (TREE if steps == 2 else (0, 1, 1))
        if steps:
            assert r.accepted == accept_tree(r.iter, bs, steps) and max(r.accepted) <= 2


def test_without_the_draft_extend_hook_a_chain_step_would_hand_the_tree_a_one_wide_top_k(tree_server, monkeypatch):
    """The failure the draft-extend hook prevents, shown on the stand-in: SGLang's relay keeps the
    width of its first stash, and a chain state's extend produces one column."""
    worker, proc, eng, _ = tree_server()
    monkeypatch.setattr(plugged_rt(), "max_topk", 1)  # the hook then leaves the width alone
    st = standin()
    worker.forward_batch_generation(st.Batch(1, 0, extend=True))  # relay width: the launch chain's 1
    eng.apply(eng._update_from_frame(frame(5, [(1, None, TREE)])))
    with pytest.raises(RuntimeError, match="size of tensor a"):
        st.run_decode(worker, proc, [1, 1], start_iter=1)


def plugged_rt():
    return sglang_hooks.runtime()


def test_a_tree_build_that_fails_leaves_a_chain_under_its_key_and_the_server_up(tree_server, caplog):
    caplog.set_level(logging.ERROR, logger="specctl.plugin")
    worker, proc, eng, rc = tree_server(fail_build=2)
    assert worker.adaptive_controller._states[2].speculative_num_draft_tokens == 3  # the chain s2
    assert eng.states[2] == (2, 1, 3) and plugged_rt().trees == {}
    assert (worker.topk, rc.bag.speculative_eagle_topk, rc.sa.speculative_eagle_topk) == (1, 1, 1)
    assert any("building the tree state s2k4n16 failed" in r.getMessage() for r in caplog.records)
    eng.apply(eng._update_from_frame(frame(6, [(1, None, TREE)])))
    assert eng.active_source == "fallback" and "runs s2" in eng.fallback_reason
    prefill_then_decode(worker, proc, [1, 2, 8], 0)  # serves on


def test_trees_are_refused_loudly_when_a_tree_hook_is_missing_or_the_skip_flag_is_set(
        tree_server, plugged, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="specctl.plugin")
    width = plugged.guard.get("trees.width")
    monkeypatch.setattr(width, "hooks", [(("nowhere.Draft.draft" if t == plugged.targets.draft else t), k, fn)
                                         for t, k, fn in width.hooks])
    monkeypatch.setattr(width, "off_reason", None)  # the check turns it off: on again for the next tests
    worker, proc, eng, _ = tree_server()
    assert eng.states[2] == (2, 1, 3) and worker.adaptive_controller._states[2].speculative_num_draft_tokens == 3
    assert any("NOT built: the tree hooks on nowhere.Draft.draft did not take effect" in r.getMessage()
               for r in caplog.records)
    monkeypatch.undo()
    # SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1, as register() reads it into the settings
    worker, proc, eng, _ = tree_server(skip_zero_step_draft_extend=True)
    assert eng.states[2] == (2, 1, 3)
    assert any("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND" in r.getMessage() for r in caplog.records)


def test_the_shared_logits_buffer_is_sized_for_the_tree_width(tree_server, monkeypatch):
    worker, _, _, rc = tree_server()
    st = standin()
    runner = st.ModelRunnerStandin(rc.sa)
    monkeypatch.setattr(sglang_source, "capture_sizes", lambda r, width: [1, 2, 4, 8, 16, 32, 48])
    assert runner.max_decode_logits_rows() == 48 * 16  # SGLang's own: 160 x 4 = 640 rows
    chain_only = st.ServerArgsStandin(rc.sa.speculative_adaptive_config, 3)
    chain_only.speculative_adaptive_config = None
    assert st.ModelRunnerStandin(chain_only).max_decode_logits_rows() == 160 * 4


def test_a_tree_launch_that_sglang_ran_statically_is_named_with_the_launch_that_works(plugged, caplog):
    """The seed operator's flags (topk 4) with --speculative-adaptive: SGLang drops adaptive mode in the
    main process with a warning there; the scheduler-side plugin says so, and what to launch instead."""
    from types import SimpleNamespace

    caplog.set_level(logging.ERROR, logger="specctl.plugin")
    worker = SimpleNamespace(adaptive_controller=None, topk=4, speculative_num_steps=2, speculative_num_draft_tokens=16)
    assert plugged._engine_of(SimpleNamespace(model_worker=worker)) is None
    msgs = [r.getMessage() for r in caplog.records]
    assert any("--speculative-eagle-topk 4" in m and "specctl sglang-args --configs off,s2k4n16" in m for m in msgs)


def test_a_malformed_specctl_section_leaves_sglang_deciding_without_the_sizing_state(tree_server, plugged, tmp_path, caplog):
    """An operator's typo in the specctl section: the engine does not start (said), SGLang's own policy
    decides, and the sizing slot's 15 steps still get no runtime state."""
    st = standin()
    cfg = {"1": {"candidate_steps": [0, 1, 2, 3]}, launch_args.SIZING_SLOT: {"candidate_steps": [15]},
           "specctl": {"states": {"2": [2, 4]}}}
    (tmp_path / "bad.json").write_text(json.dumps(cfg))
    caplog.set_level(logging.ERROR, logger="specctl.plugin")
    rc = st.RuntimeContextStandin(st.ServerArgsStandin(str(tmp_path / "bad.json"), 3))
    worker = st.TreeWorkerStandin(3, str(tmp_path / "bad.json"), accept_tree, rc)
    worker.init_cuda_graphs(list(CUDA_GRAPH_BS))
    assert worker.adaptive_controller.params.specctl is None
    assert sorted(worker.adaptive_controller._states) == [0, 1, 2, 3]
    assert any("engine start failed" in r.getMessage() and "specctl.states.2" in r.getMessage() for r in caplog.records)
