"""`specctl train`: crossover recovery from known ground truth (telemetry from synth and from the
simulator through the recorder, SGLang decode logs, bench_serving sweeps), refusals, the CLI."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specctl.controller import wire
from specctl.controller.cli import main as cli_main
from specctl.controller.recorder import Recorder
from specctl.policies.table import PolicyTable
from specctl.training import simulator as sim
from specctl.training import synth
from specctl.training.train import report_markdown, train

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
sys.path.insert(0, str(FIX))  # the fixture generators are plain modules beside the logs
import sglang_gen  # noqa: E402
OFF, S1, S3 = (0, 1, 1), (1, 1, 2), (3, 1, 4)



def write_jsonl_gz(path, records):
    with gzip.open(path, "wt") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def within(got, truth, tol):
    assert got is not None and truth is not None
    assert abs(got - truth) <= tol * truth, f"crossover {got} vs truth {truth} (±{tol:.0%})"


# ------------------------------------------------------------------------- telemetry (±10%)


@pytest.mark.parametrize("crossover", [10, 24, 60, 140])
def test_crossover_from_synthetic_telemetry_within_10_percent(tmp_path, crossover):
    truth = synth.truth_with_crossover(crossover)
    recs = synth.generate(truth, num_steps=16000, seed=crossover,
                          batch_sizes=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256])
    policy, report = train([write_jsonl_gz(tmp_path / "t.jsonl.gz", recs)])
    assert report.ok, report.missing
    within(report.crossover, truth.crossover(), 0.10)
    assert policy.source == "file" and policy.model["spec_off_crossover"] == report.crossover


class RecordingPolicy:
    """A simulator policy that visits every configuration in blocks of `dwell` steps and records
    what the engine would send, through the `specctl serve --record` writer."""

    name = "recording"

    def __init__(self, configs, recorder, dwell=16):
        self.configs, self.recorder, self.dwell, self.n = list(configs), recorder, dwell, 0

    def decide(self, batch_size):
        return self.configs[(self.n // self.dwell) % len(self.configs)]

    def observe(self, batch_size, config, accepted, step_ms, now_s):
        acc = None if config[0] == 0 else [int(a) for a in np.asarray(accepted).ravel()[:batch_size]]
        self.recorder.write(wire.encode_step_fields(
            server="sim-0", rank=0, iter=self.n, ts=1_764_441_600.0 + now_s, batch_size=batch_size,
            steps=config[0], topk=config[1], draft_tokens=config[2], accepted=acc, step_ms=step_ms))
        self.n += 1


def true_crossover(profile, tau, max_batch=2048):
    b = np.arange(1, max_batch + 1)
    g = np.vstack([b * tau[i] / np.array([profile.step_ms(i, int(x)) for x in b])
                   for i in range(profile.num_configs)])
    best = [profile.configs[i] for i in np.argmax(g, axis=0)]
    last = max((i for i, c in enumerate(best) if c[0] > 0), default=None)
    return 1 if last is None else (None if last == len(best) - 1 else last + 2)


@pytest.mark.slow
@pytest.mark.parametrize("profile_name, accept0", [("h200-smollm2-135m-inflated-5.2b", 0.6),
                                                   ("h200-smollm2-135m-inflated-5.2b", 0.7),
                                                   ("dense-8b-h200", 0.6)])
def test_crossover_from_simulator_recordings_within_10_percent(tmp_path, profile_name, accept0):
    profile = sim.load_profile(profile_name)
    acc = [accept0 - 0.05 * i for i in range(8)]
    cls = {"c": {"accept": {sim.config_name(c): acc[:c[0]] for c in profile.configs if c[0] > 0},
                 "output_tokens": [128, 512]}}
    wl = sim.parse_workload({"schema": "specctl.workload/1", "seed": 2, "classes": cls,
                             "phases": [{"duration_s": 20, "concurrency": c, "mix": {"c": 1}}
                                        for c in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)]})
    tau = sim.expected_tau(sim.accept_matrix(profile, wl))[0]
    rec_dir = tmp_path / "rec"
    rec = Recorder(rec_dir, max_bytes=512 << 20, rotate_bytes=256 << 10)
    sim.simulate(profile, wl, RecordingPolicy(profile.configs, rec))
    rec.close()
    assert len(rec.files()) > 1  # rotated
    policy, report = train([rec_dir])
    assert report.ok, report.missing
    within(report.crossover, true_crossover(profile, tau), 0.10)


# ------------------------------------------------------------------------- SGLang logs (±25%)


@pytest.mark.parametrize("crossover", [12, 40, 90])
@pytest.mark.parametrize("kind", ["sweep-0.5.17", "adaptive-0.5.23"])
def test_crossover_from_sglang_decode_logs_within_25_percent(tmp_path, crossover, kind):
    g = sglang_gen
    truth = synth.truth_with_crossover(crossover)
    levels = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    if kind.startswith("sweep"):
        lines = g.sweep_logs(truth, version="0.5.17", levels=levels, steps_per_level=600, seed=crossover)
    else:
        lines = g.simulate_log(truth, version="0.5.23", adaptive=True, levels=levels,
                               steps_per_level=1200, seed=crossover, tags=" TP0", log_ms=True)
    p = tmp_path / "server.log"
    p.write_text("\n".join(lines) + "\n")
    policy, report = train([p])
    assert report.ok, report.missing
    within(report.crossover, truth.crossover(), 0.25)
    if kind.startswith("adaptive"):
        assert report.files[0].skipped["configuration changed inside the interval"] > 0


def test_committed_log_fixtures_train_a_policy_near_the_truth():
    truth = json.loads((FIX / "truth.json").read_text())
    policy, report = train([FIX / "sglang-0.5.17-sweep.log", FIX / "sglang-0.5.23-adaptive-tp2.log"])
    assert report.ok, report.missing
    assert report.crossover is not None
    # short fixtures (3 concurrency levels each): the looser tolerance of interval-averaged logs
    assert abs(report.crossover - truth["crossover"]) <= 0.35 * truth["crossover"]


# ------------------------------------------------------------------------- bench_serving


def test_bench_sweep_picks_the_best_measured_configuration_at_each_concurrency():
    policy, report = train([FIX / "bench_serving-sweep.jsonl"])
    assert report.ok, report.missing
    table = PolicyTable.from_policy_obj(wire.to_obj(policy))
    rows = [json.loads(ln) for ln in (FIX / "bench_serving-sweep.jsonl").read_text().splitlines()
            if ln.startswith("{")]
    best = {}
    for r in rows:
        info = r.get("server_info")
        if not info or info.get("speculative_adaptive"):
            continue
        c = (0, 1, 1) if not info["speculative_algorithm"] else (
            info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"])
        k = r["max_concurrency"]
        if r["output_throughput"] > best.get(k, (None, -1))[1]:
            best[k] = (c, r["output_throughput"])
    assert set(best) == {1, 4, 16, 64}
    for k, (c, _) in best.items():
        assert table.lookup(k) == c, (k, table.lookup(k), c)
    assert best[16][0] == S1  # the fixture's measured twist: the smooth truth says s3 there
    assert [(c.concurrency, c.best, c.table) for c in report.bench] == [
        (k, best[k][0], best[k][0]) for k in sorted(best)]
    md = report_markdown(report, policy)
    assert "| 16 | off " in md and "best measured" in md


@pytest.mark.parametrize("seed", range(5))
def test_bench_measured_best_wins_even_against_the_fit(tmp_path, seed):
    g = sglang_gen
    rng = np.random.default_rng(seed)
    truth = synth.truth_with_crossover(24, steps=3)
    s1 = synth.ConfigTruth(S1, 7.0, 0.1, (0.8,))
    configs = list(truth.configs) + [s1]
    lines, measured = [], {}
    for ct in configs:
        for c in (1, 2, 4, 8, 16, 32, 64, 128):
            ms = float(ct.step_ms(c)) * float(rng.uniform(0.85, 1.15))  # noisy, non-linear runs
            r = g.bench_result("0.5.17", ct.config, c, step_ms=ms, tau=ct.tokens_per_step())
            lines.append(json.dumps(r))
            if r["output_throughput"] > measured.get(c, (None, 0))[1]:
                measured[c] = (ct.config, r["output_throughput"])
    p = tmp_path / "b.jsonl"
    p.write_text("\n".join(lines) + "\n")
    policy, report = train([p])
    assert report.ok, report.missing
    table = PolicyTable.from_policy_obj(wire.to_obj(policy))
    for c, (cfg, _) in measured.items():
        assert table.lookup(c) == cfg


# ------------------------------------------------------------------------- evidence


def test_refuses_when_off_was_only_measured_at_small_batches(tmp_path):
    truth = synth.truth_with_crossover(40)
    recs = [r for r in synth.generate(truth, num_steps=12000, seed=1,
                                      batch_sizes=[1, 2, 4, 8, 12, 16, 24, 32, 48, 64])
            if r["config"]["steps"] > 0 or r["batch_size"] <= 16]
    policy, report = train([write_jsonl_gz(tmp_path / "t.jsonl.gz", recs)])
    assert policy is None
    assert any(m.startswith("no steps measured with speculation off above batch 16") for m in report.missing), \
        report.missing
    md = report_markdown(report, None)
    assert "No policy written" in md and "above batch 16" in md


@pytest.mark.parametrize("keep, message", [
    (lambda r: r["config"]["steps"] > 0, "no steps measured with speculation off"),
    (lambda r: r["config"]["steps"] == 0, "no steps measured with speculation on"),
])
def test_refuses_without_one_side(tmp_path, keep, message):
    truth = synth.truth_with_crossover(20)
    recs = [r for r in synth.generate(truth, num_steps=3000, seed=2, batch_sizes=[1, 8, 32]) if keep(r)]
    policy, report = train([write_jsonl_gz(tmp_path / "t.jsonl.gz", recs)])
    assert policy is None and report.missing[0].startswith(message)


def test_refuses_on_garbage_only_and_reports_every_file(tmp_path):
    policy, report = train([FIX / "garbage.bin", FIX / "unknown-notes.txt", tmp_path / "missing.log"])
    assert policy is None
    assert report.missing == ["no usable samples in the inputs (see the per-file report)"]
    assert [f.format for f in report.files] == ["unknown", "unknown", "unknown"]
    assert len(report.warnings) == 3


def test_refuses_when_the_crossover_region_was_not_measured(tmp_path):
    truth = synth.truth_with_crossover(40)
    recs = synth.generate(truth, num_steps=8000, seed=3, batch_sizes=[1, 2, 4, 8, 200, 256])
    policy, report = train([write_jsonl_gz(tmp_path / "t.jsonl.gz", recs)])
    assert policy is None
    assert any("the fitted spec→off crossover" in m for m in report.missing), report.missing


def test_mixed_inputs_combine(tmp_path):
    """Speculative steps from a telemetry recording, plain decode from a server log."""
    g = sglang_gen
    truth = synth.truth_with_crossover(30)
    spec = [r for r in synth.generate(truth, num_steps=8000, seed=4, batch_sizes=[1, 4, 8, 16, 32, 64, 128])
            if r["config"]["steps"] > 0]
    off_only = synth.GroundTruth((truth.configs[0],))
    log = g.simulate_log(off_only, static=OFF, levels=(1, 4, 8, 16, 32, 64, 128), steps_per_level=600)
    (tmp_path / "off.log").write_text("\n".join(log) + "\n")
    policy, report = train([write_jsonl_gz(tmp_path / "spec.jsonl.gz", spec), tmp_path / "off.log"])
    assert report.ok, report.missing
    assert [f.format for f in report.files] == ["telemetry", "sglang-log"]
    within(report.crossover, truth.crossover(), 0.15)


def test_candidates_restrict_the_table(tmp_path):
    policy, report = train([FIX / "bench_serving-sweep.jsonl"], candidates=[OFF, S3])
    assert report.ok
    assert {r.config.key for r in policy.table} <= {OFF, S3}


# ------------------------------------------------------------------------- CLI


def test_cli_writes_a_policy_file_report_and_plot(tmp_path):
    out, md, png = tmp_path / "policy.json", tmp_path / "fit.md", tmp_path / "fit.png"
    res = CliRunner().invoke(cli_main, ["train", str(FIX / "bench_serving-sweep.jsonl"),
                                        str(FIX / "telemetry-synth.jsonl.gz"), str(FIX / "garbage.bin"),
                                        "--out", str(out), "--report", str(md), "--plot", str(png),
                                        "--progress"])
    assert res.exit_code == 0, res.output
    policy = wire.decode_policy(out.read_bytes())
    assert policy.source == "file" and policy.version >= 1
    assert policy.model["training"]["samples"] > 2000
    text = md.read_text()
    assert "garbage.bin | unknown" in text and "bad_schema_version" in text
    assert "skipped 1: not JSON (lines 10)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in res.output and "telemetry-synth.jsonl.gz: telemetry, 2404 lines, 2400 used" in res.output
    shown = CliRunner().invoke(cli_main, ["policy", "show", "--file", str(out)])
    assert shown.exit_code == 0, shown.output


def test_cli_refuses_with_exit_2_and_still_writes_the_report(tmp_path):
    out, md = tmp_path / "policy.json", tmp_path / "fit.md"
    res = CliRunner().invoke(cli_main, ["train", str(FIX / "unknown-notes.txt"), "--out", str(out),
                                        "--report", str(md)])
    assert res.exit_code == 2
    assert not out.exists()
    assert "no usable samples" in res.output and "No policy written" in md.read_text()


# ------------------------------------------------------------------------- context


def _alternating(tmp_path, n=30000, seed=11):
    """Telemetry whose traffic alternates between ~300 and ~6000 context tokens a request every 2000
    steps, on an engine whose spec->off crossover is 76 at the short context and 14 at the long."""
    truth = synth.truth_with_ctx_crossovers((300, 76), (6000, 14))
    recs = synth.generate(truth, num_steps=n, batch_sizes=list(range(1, 129)), seed=seed, ctx_per_request=[300, 6000])
    return truth, write_jsonl_gz(tmp_path / "alternating.jsonl.gz", recs)


def test_alternating_contexts_train_a_table_per_band_that_does_not_flap(tmp_path):
    truth, path = _alternating(tmp_path)
    flat, flat_report = train([path], ctx_axis=False)
    assert flat_report.ok and not flat_report.ctx_bands
    # one table for both contexts: s3 and off take turns, batch size after batch size, from 17 to 128
    assert len(flat.table) > 20 and all(r.ctx_band is None for r in flat.table)
    policy, report = train([path])
    assert report.ok, report.missing
    t = PolicyTable.from_policy_obj(wire.to_obj(policy))
    assert t.rows == PolicyTable.from_policy_obj(wire.to_obj(flat)).rows  # the rows for any context stay
    assert len(t.bands) >= 2 and t.bands[0].min_ctx == 0 and t.bands[-1].max_ctx is None
    for band in t.bands:  # no flapping: every band speculates below one batch size and decodes plainly above
        assert [r.config for r in band.rows] == [S3, OFF]
    for mean, tol in ((300, 0.1 * 76), (6000, 2)):
        got = PolicyTable(rows=t.rows_for(mean)).spec_off_crossover()
        assert abs(got - truth.crossover(mean_ctx=mean)) <= tol, (mean, got)
    assert [b["min_ctx"] for b in policy.model["ctx_bands"]] == [b.min_ctx for b in t.bands]
    md = report_markdown(report, policy)
    assert "## Context bands" in md and "| 4096+ | s3 1–13, off 14+ | batch 14 |" in md
    assert report.to_obj()["ctx_bands"][-1]["crossover"] == 14


def test_train_cli_context_axis_flag(tmp_path):
    _, path = _alternating(tmp_path, n=12000)
    for flag, banded in (("--ctx-axis", True), ("--no-ctx-axis", False)):
        out = tmp_path / f"p{flag}.json"
        res = CliRunner().invoke(cli_main, ["train", str(path), "--out", str(out), flag])
        assert res.exit_code == 0, res.output
        pol = wire.decode_policy(out.read_bytes())
        assert any(r.ctx_band is not None for r in pol.table) is banded
        assert ("context 4096+ tokens a request" in res.output) is banded
