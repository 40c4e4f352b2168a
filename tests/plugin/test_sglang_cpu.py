"""The plugin inside the real SGLang modules on CPU (hook registry, plugin loader, AdaptiveController,
AdaptiveSpeculativeParams, the TP GroupCoordinator), with real ZeroMQ sockets."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from specctl.controller import transport
from specctl.plugin import launch_args
from specctl.policies.table import Band, PolicyTable, Row, chain



def load_standin():
    return sys.modules["specctl_sglang_standin"]  # loaded by the `plugged` fixture (conftest.py)

pytestmark = pytest.mark.sglang

HERE = Path(__file__).parent
CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 32, 64]
SIZES = [(i * 7) % 13 + 1 for i in range(240)]  # 1..13, every size, in a scrambled order


class Clock:
    def __init__(self, t: float = 5000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def policy_frame(version: int, rows, source: str = "online", bands=(), explore=()) -> bytes:
    """bands: ((min_ctx, max_ctx, rows), ...), rows as (min_batch, max_batch, steps); explore: Rows."""
    table = PolicyTable(rows=tuple(Row(a, b, chain(s)) for a, b, s in rows), version=version, source=source,
                        bands=tuple(Band(lo, hi, tuple(Row(a, b, chain(s)) for a, b, s in rs)) for lo, hi, rs in bands))
    obj = {"kind": "policy", "schema": 1, "version": version, "created_at": time.time(),
           "source": source, "table": table.to_rows_obj()}
    if explore:
        from specctl.policies.table import rows_to_obj

        obj.update(explore=rows_to_obj(explore), explore_period=64)
    return json.dumps(obj).encode()


def accept_all(forward_iter: int, batch_size: int, steps: int) -> list[int]:
    return [(forward_iter + i) % (steps + 1) for i in range(batch_size)]


@pytest.fixture
def server(plugged, tmp_path):
    """A fresh scheduler-side stack per test: adaptive config from `specctl sglang-args`'s logic,
    the stand-in worker holding SGLang's real AdaptiveController, our policy inside it."""
    st = load_standin()
    base = plugged.settings
    if plugged.receiver is not None:
        plugged.receiver.poll()  # drop what an earlier test's publisher left queued

    def make(candidates=(0, 1, 3), *, initial=3, clock=None, accept=accept_all, **settings_kw):
        plugged.clock = clock or Clock()
        plugged.settings = dataclasses.replace(base, **settings_kw)
        args = launch_args.build([chain(s) for s in candidates], initial_steps=initial,
                                 config_path=str(tmp_path / "adaptive.json"))
        (tmp_path / "adaptive.json").write_text(json.dumps(args.adaptive_config))
        worker = st.EAGLEWorkerV2Standin(initial, str(tmp_path / "adaptive.json"), accept)
        worker.init_cuda_graphs(list(CUDA_GRAPH_BS))
        eng = worker.adaptive_controller.params.specctl
        assert eng is not None and plugged.engine is eng
        return worker, st.ResultProcessorStandin(worker), eng

    yield make
    plugged.settings = base


def publish_until(pub, frame, worker, proc, cond, *, start_iter=0, timeout_s=60.0) -> int:
    """Publish (as the daemon's heartbeat does) while decoding until `cond()` holds."""
    st = load_standin()
    it = start_iter
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "policy never applied"
        pub.send(frame)
        time.sleep(0.01)
        it = st.run_decode(worker, proc, SIZES[:16], start_iter=it)
    return it


# ----------------------------------------------------------------------------- loading


def _run_py(code: str, env_extra=None) -> dict:
    env = {**os.environ, **(env_extra or {})}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_discovered_by_load_plugins_and_acts_in_scheduler_processes_only():
    probe = """
        import json, sys
        import sglang.srt.speculative.adaptive_runtime_state as ars   # imported before the patch
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        import sglang.srt.speculative.adaptive_spec_params as asp
        {call}
        print(json.dumps({{
            "hooks": sorted(HookRegistry._hooks), "patched": sorted(HookRegistry._patched),
            "cls": asp.AdaptiveSpeculativeParams.__name__,
            "base": asp.AdaptiveSpeculativeParams.__mro__[1].__name__,
            "ars_global": getattr(ars, "AdaptiveSpeculativeParams", asp.AdaptiveSpeculativeParams).__name__,
        }}))
    """
    main = _run_py(probe.format(call="load_plugins()"))
    assert not any("adaptive_spec_params" in h for h in main["hooks"])  # main process: nothing
    assert main["cls"] == "AdaptiveSpeculativeParams"

    sched = _run_py(probe.format(call="def run_scheduler_process():\n            load_plugins()\n"
                                      "        run_scheduler_process()"))
    policy_target = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
    assert policy_target in sched["hooks"] and policy_target in sched["patched"]
    assert any(h.endswith("EAGLEWorkerV2.forward_batch_generation") for h in sched["hooks"])
    assert any(h.endswith("._resolve_spec_v2_tokens") for h in sched["hooks"])
    assert sched["cls"] == "SpecctlSpeculativeParams" and sched["base"] == "AdaptiveSpeculativeParams"
    assert sched["ars_global"] == "SpecctlSpeculativeParams"  # 0.5.17's `from ... import` rebound

    whitelisted_out = _run_py(probe.format(call="def run_scheduler_process():\n            load_plugins()\n"
                                                "        run_scheduler_process()"),
                              {"SGLANG_PLUGINS": "someone_else"})
    assert whitelisted_out["cls"] == "AdaptiveSpeculativeParams"


def test_startup_check_names_the_hooks_that_did_not_take_effect(server, plugged, caplog):
    caplog.set_level(logging.ERROR, logger="specctl.plugin")
    server()
    # on CPU the worker, TP-worker and result-processor modules cannot be imported, so SGLang failed
    # to apply those hooks (the step timing, the result hook, the steps-0 token dtype, the decode state's three, on 0.5.17
    # the draft-extend width hook on spec_utils and the speculative KV allocation's on eagle_utils, and with
    # the split-KV kernel on, the default, the one on the triton backend); the REPLACE on the policy class went in
    from specctl.plugin import sglang_source

    problems = plugged.hook_problems
    width = sglang_source.draft_width_needed()  # 0.5.17: its spec_utils sizes graphs from ServerArgs
    splitkv = plugged.settings.splitkv_verify
    alloc = sglang_source.spec_alloc_reads_scalars()  # 0.5.17: the KV lengths one tensor scalar at a time
    assert len(problems) == 6 + width + splitkv + alloc
    assert sum("alloc_for_spec_decode" in p and "2 ATen calls" in p for p in problems) == alloc
    assert sum("_build_trivial_verify_input" in p and "disable-overlap-schedule" in p for p in problems) == 1
    assert sum("TritonAttnBackend.__init__" in p and "extend kernel" in p for p in problems) == splitkv
    assert sum("resolve_num_tokens_per_req" in p and "extend eagerly" in p for p in problems) == width
    assert any("EAGLEWorkerV2.forward_batch_generation" in p for p in problems)
    assert any("_resolve_spec_v2_tokens" in p and "fallback" in p for p in problems)
    assert sum("no decode state" in p for p in problems) == 3
    assert any("EAGLEWorkerV2.verify" in p for p in problems)
    assert not any("AdaptiveSpeculativeParams" in p for p in problems)
    assert sum("did not take effect" in r.getMessage() for r in caplog.records) >= 2


# ----------------------------------------------------------------------------- decisions


def test_real_adaptive_controller_switches_exactly_as_the_policy_table_says(server, plugged):
    worker, proc, eng = server()
    # every candidate got a runtime state, each with CUDA graphs at every batch size
    assert sorted(set(worker.built) | {3}) == [0, 1, 3]
    assert all(bs == CUDA_GRAPH_BS for bs in worker.built.values())
    rows = [(1, 2, 3), (3, 8, 1), (9, None, 0)]
    table = PolicyTable.from_rows([(a, b, chain(s)) for a, b, s in rows])
    pub = transport.policy_pub(zmq.Context.instance(), plugged.settings.policy_endpoint)
    try:
        it = publish_until(pub, policy_frame(11, rows), worker, proc, lambda: eng.active_version == 11)
    finally:
        pub.close(linger=0)
    first = it
    worker.switches.clear()
    load_standin().run_decode(worker, proc, SIZES, start_iter=first)
    chosen = [worker.used[i] for i in range(first, first + len(SIZES))]
    assert [s for _, s in chosen] == [table.lookup(bs)[0] for bs, _ in chosen]
    # SGLang's controller applied a state switch at every change of the chosen steps, and only then
    seq = [s for _, s in chosen]
    expected_switches = sum(1 for a, b in zip(seq, seq[1:]) if a != b)
    assert len(worker.switches) in (expected_switches, expected_switches + 1)
    assert eng.active_source == "online" and eng.fallback_reason is None


def test_no_daemon_means_the_fixed_threshold_fallback(server, plugged):
    clock = Clock()
    worker, proc, eng = server(clock=clock)
    st = load_standin()
    it = st.run_decode(worker, proc, SIZES[:40])
    assert eng.active_source == "fallback" and "no policy received yet" in eng.fallback_reason
    assert all(s == (3 if bs < 5 else 0) for bs, s in worker.used.values())
    clock.t += 6
    st.run_decode(worker, proc, SIZES[:8], start_iter=it)
    assert eng.fallback_reason.startswith("no daemon")


def test_stale_policy_falls_back_and_recovers_on_the_next_heartbeat(server, plugged):
    clock = Clock()
    worker, proc, eng = server(clock=clock)
    frame = policy_frame(21, [(1, None, 1)])
    pub = transport.policy_pub(zmq.Context.instance(), plugged.settings.policy_endpoint)
    try:
        it = publish_until(pub, frame, worker, proc, lambda: eng.active_version == 21)
        clock.t += 5.5  # no frame for longer than SPECCTL_STALE_AFTER_S=5
        worker.used.clear()
        it = load_standin().run_decode(worker, proc, SIZES[:40], start_iter=it)
        assert eng.active_source == "fallback" and "stale" in eng.fallback_reason
        tail = list(worker.used.values())[-20:]
        assert all(s == (3 if bs < 5 else 0) for bs, s in tail)
        publish_until(pub, frame, worker, proc, lambda: eng.active_version == 21, start_iter=it)
    finally:
        pub.close(linger=0)
    assert eng.active_source == "online"


def test_policy_naming_a_step_without_runtime_state_is_refused(server, plugged):
    worker, proc, eng = server(candidates=(0, 1, 3))
    pub = transport.policy_pub(zmq.Context.instance(), plugged.settings.policy_endpoint)
    try:
        publish_until(pub, policy_frame(31, [(1, 4, 7), (5, None, 0)]), worker, proc,
                      lambda: eng.fallback_reason is not None and "steps=7" in eng.fallback_reason)
    finally:
        pub.close(linger=0)
    assert eng.active_source == "fallback"
    assert {s for _, s in worker.used.values()} <= {0, 1, 3}  # never asked SGLang for steps=7


def test_exception_inside_the_plugin_keeps_the_server_serving(server, plugged):
    worker, proc, eng = server()

    class Broken:
        def decide(self, batch_size, step_counter, ctx_tokens=None):
            raise RuntimeError("injected")

    eng.table = Broken()
    load_standin().run_decode(worker, proc, SIZES[:30])
    assert eng.failed and "injected" in eng.failed
    assert all(s == (3 if bs < 5 else 0) for bs, s in worker.used.values())


def test_telemetry_error_turns_telemetry_off_and_leaves_decisions_alone(server, plugged):
    worker, proc, eng = server()
    sender = plugged.sender

    class Boom:
        def send(self, frame):
            raise OSError("injected")

    plugged.sender, was_on = Boom(), plugged.telemetry_on
    plugged.telemetry_on = True
    try:
        load_standin().run_decode(worker, proc, SIZES[:30])
        assert plugged.telemetry_on is False
        assert eng.failed is None and all(s == (3 if bs < 5 else 0) for bs, s in worker.used.values())
    finally:
        plugged.sender, plugged.telemetry_on = sender, was_on


# ----------------------------------------------------------------------------- telemetry


def test_telemetry_frames_attribute_each_step_to_the_width_that_produced_it(server, plugged):
    worker, proc, eng = server()
    rows = [(1, 3, 3), (4, 9, 1), (10, None, 0)]  # switches almost every step with SIZES
    st = load_standin()
    t_before = time.time()
    first, recs = st.telemetry_during(
        plugged.settings,
        lambda pub: publish_until(pub, policy_frame(41, rows), worker, proc, lambda: eng.active_version == 41),
        lambda it: st.run_decode(worker, proc, [2], start_iter=it, overlap=False),
        lambda first: st.run_decode(worker, proc, SIZES[:100], start_iter=first, overlap=True))
    t_after = time.time()
    assert [r.iter for r in recs] == list(range(first, first + 100))  # one frame a step, none lost
    for r in recs:
        bs, steps = worker.used[r.iter]
        assert (r.batch_size, r.config.steps) == (bs, steps)
        assert r.server == "cpu-test" and r.rank == 0 and r.step_ms > 0
        if steps:
            assert r.accepted == accept_all(r.iter, bs, steps)
        assert r.off_path == (None if steps else "verify")  # no decode state on these stand-ins
        assert t_before <= r.ts <= t_after  # the wall-clock time of the step


# ----------------------------------------------------------------------------- context bands

BANDS = ((0, 1023, [(1, 9, 3), (10, None, 0)]), (1024, None, [(1, 3, 1), (4, None, 0)]))


def _alternating_ctx(it: int, bs: int) -> list[int]:
    """Requests of ~300 context tokens for 25 batches, then ~6000 (varying within a batch)."""
    mean = 300 if (it // 25) % 2 == 0 else 6000
    return [mean - 20 + (i * 13) % 41 for i in range(bs)]


def test_decisions_follow_the_band_of_the_batch_context_and_telemetry_carries_it(server, plugged):
    worker, proc, eng = server()
    rows = [(1, 4, 3), (5, None, 0)]
    st = load_standin()
    first, recs = st.telemetry_during(
        plugged.settings,
        lambda pub: publish_until(pub, policy_frame(51, rows, bands=BANDS), worker, proc,
                                  lambda: eng.active_version == 51),
        lambda it: st.run_decode(worker, proc, [2], start_iter=it, overlap=False, ctx_of=_alternating_ctx),
        lambda first: st.run_decode(worker, proc, SIZES[:150], start_iter=first, ctx_of=_alternating_ctx))
    table = PolicyTable.from_policy_obj(json.loads(policy_frame(51, rows, bands=BANDS)))
    chosen = [(i, *worker.used[i]) for i in range(first, first + 150)]
    assert [s for _, _, s in chosen] == [table.lookup(bs, sum(_alternating_ctx(i, bs)))[0] for i, bs, _ in chosen]
    assert {s for _, bs, s in chosen if bs in (6, 8)} == {0, 3}  # the same batch size, both bands' choices
    assert [r.iter for r in recs] == list(range(first, first + 150))  # one frame a step, none lost
    for r in recs:
        assert r.ctx_tokens == sum(_alternating_ctx(r.iter, r.batch_size))  # the context the decision saw


def test_a_batch_whose_context_cannot_be_read_uses_the_rows_naming_none(server, plugged, caplog):
    worker, proc, eng = server()
    rows = [(1, 4, 3), (5, None, 0)]
    pub = transport.policy_pub(zmq.Context.instance(), plugged.settings.policy_endpoint)
    try:
        it = publish_until(pub, policy_frame(61, rows, bands=BANDS), worker, proc, lambda: eng.active_version == 61)
    finally:
        pub.close(linger=0)
    worker.used.clear()
    unreadable = set(range(it, it + 40, 3))  # every third batch's requests have no committed length
    with caplog.at_level(logging.WARNING, logger="specctl.plugin"):
        load_standin().run_decode(worker, proc, SIZES[:40], start_iter=it,
                                  ctx_of=lambda i, bs: None if i in unreadable else _alternating_ctx(i, bs))
    table = PolicyTable.from_policy_obj(json.loads(policy_frame(61, rows, bands=BANDS)))
    for i, (bs, s) in worker.used.items():
        want = table.lookup(bs, None if i in unreadable else sum(_alternating_ctx(i, bs)))[0]
        assert s == want, (i, bs, s, want)
    assert eng.failed is None and "context is unreadable" in caplog.text


# ----------------------------------------------------------------------------- tensor parallel


@pytest.mark.slow
def test_two_gloo_ranks_make_identical_choices_while_policies_land_mid_run(tmp_path):
    endpoint = f"ipc://{tmp_path}/policy.sock"
    ctx = zmq.Context.instance()
    pub = transport.policy_pub(ctx, endpoint)
    with socket.socket() as s:  # a free loopback port for torch.distributed's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(HERE / "tp_rank.py"), str(r), "2", str(port),
                               endpoint, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    tables = {v: [(1, 4, 3), (5, None, 0)] if v % 3 == 1 else
              [(1, 8, 1), (9, None, 3)] if v % 3 == 2 else [(1, None, 1)] for v in range(1, 200)}
    bands = {v: BANDS if v % 3 == 0 else () for v in tables}  # every third version decides by context
    # and every third explores s1 at long contexts only (a policy without bands that still reads the context)
    explore = {v: (Row(1, None, chain(1), min_ctx=1024),) if v % 3 == 2 else () for v in tables}
    version = 0
    deadline = time.monotonic() + 240
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "TP ranks did not finish (hang?)"
            if (tmp_path / "running").exists():
                version += 1
                pub.send(policy_frame(version, tables[version], bands=bands[version], explore=explore[version]))
            time.sleep(0.12)
    finally:
        pub.close(linger=0)
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs = [p.stdout.read().decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(o[-3000:] for o in outs)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert logs[0]["receiver"] and not logs[1]["receiver"]  # only TP rank 0 listens
    assert logs[0]["steps"] == logs[1]["steps"] and logs[0]["versions"] == logs[1]["versions"]
    assert len(logs[0]["steps"]) >= 3000
    assert logs[0]["num_broadcasts"] == logs[1]["num_broadcasts"] == 3000 // 8
    applied = [v for v in logs[0]["versions"] if v is not None]
    assert len(set(applied)) >= 3, f"too few policy versions landed mid-run: {sorted(set(applied))}"
    assert logs[0]["ctx"] == logs[1]["ctx"]
    for i, (bs, steps, v, ctx) in enumerate(zip(logs[0]["sizes"], logs[0]["steps"], logs[0]["versions"], logs[0]["ctx"])):
        want = PolicyTable.from_policy_obj(json.loads(policy_frame(v, tables[v], bands=bands[v], explore=explore[v]))) \
            .decide(bs, i, ctx)[0] if v is not None else (3 if bs < 5 else 0)
        assert steps == want, (i, bs, steps, v, ctx, want)
    assert any(bands[v] for v in applied), "no banded policy landed mid-run"
    assert any(explore[v] for v in applied), "no policy with a context band's exploring row landed mid-run"


def test_file_mode_and_off_mode_through_register(tmp_path):
    pol = tmp_path / "policy.json"
    pol.write_bytes(policy_frame(5, [(1, 6, 1), (7, None, 0)], source="file"))
    (tmp_path / "adaptive.json").write_text(json.dumps({"1": {"candidate_steps": [0, 1, 3]}}))
    code = f"""
        import importlib.util, json, sys
        from sglang.srt.plugins import load_plugins
        def run_scheduler_process():
            load_plugins()
        run_scheduler_process()
        import sglang.srt.speculative.adaptive_spec_params as asp
        if asp.AdaptiveSpeculativeParams.__name__ != "SpecctlSpeculativeParams":
            print(json.dumps({{"cls": asp.AdaptiveSpeculativeParams.__name__}})); sys.exit(0)
        spec = importlib.util.spec_from_file_location("st", {str(HERE / "sglang_standin.py")!r})
        st = importlib.util.module_from_spec(spec); spec.loader.exec_module(st)
        w = st.EAGLEWorkerV2Standin(3, {str(tmp_path / "adaptive.json")!r}, lambda it, bs, s: [0] * bs)
        w.init_cuda_graphs([1, 2, 4, 8])
        st.run_decode(w, st.ResultProcessorStandin(w), [1, 6, 7, 30, 2])
        eng = w.adaptive_controller.params.specctl
        print(json.dumps({{"cls": "SpecctlSpeculativeParams", "steps": [w.used[i][1] for i in range(5)],
                          "source": eng.active_source, "version": eng.active_version}}))
    """
    got = _run_py(code, {"SPECCTL_POLICY_FILE": str(pol), "SPECCTL_TELEMETRY": "none"})
    assert got == {"cls": "SpecctlSpeculativeParams", "steps": [1, 1, 0, 0, 1], "source": "file", "version": 5}
    got = _run_py(code, {"SPECCTL_MODE": "off"})
    assert got == {"cls": "AdaptiveSpeculativeParams"}
