"""Readers: SGLang server logs (0.5.17 / 0.5.23 formats), bench_serving JSONL, telemetry JSONL(.gz).

Fixtures under tests/fixtures/logs/ are built with SGLang's own format strings
(make_fixtures.py, sglang_gen.py); their ground truth is truth.json.
"""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from specctl.training.readers import (
    FileReport,
    detect_format,
    draft_widths_consistent,
    estimate_prefill_ms,
    expand_inputs,
    parse_server_args,
    read_file,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "logs"
sys.path.insert(0, str(FIX))  # the fixture generators are plain modules beside the logs
import sglang_gen  # noqa: E402
import sglang_real  # noqa: E402
TRUTH = json.loads((FIX / "truth.json").read_text())
OFF, S1, S3 = (0, 1, 1), (1, 1, 2), (3, 1, 4)
NAMES = {OFF: "off", S1: "s1", S3: "s3"}



def true_ms(config, b):
    base, slope, _ = TRUTH["configs"][NAMES[config]]
    return base + slope * b


def read(path, **kw):
    rep = FileReport(path=str(path))
    return list(read_file(path, rep, **kw)), rep


def write_log(tmp_path, lines, name="x.log"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# ------------------------------------------------------------------------- format detection


@pytest.mark.parametrize("name, fmt", [
    ("sglang-0.5.17-sweep.log", "sglang-log"),
    ("sglang-0.5.23-adaptive-tp2.log", "sglang-log"),
    ("bench_serving-sweep.jsonl", "bench-serving"),
    ("telemetry-synth.jsonl.gz", "telemetry"),
    ("telemetry-truncated.jsonl.gz", "telemetry"),
    ("unknown-notes.txt", "unknown"),
    ("garbage.bin", "unknown"),
])
def test_detects_the_format_of_each_fixture(name, fmt):
    got, problem = detect_format(FIX / name)
    assert got == fmt
    assert (problem is None) == (fmt != "unknown")


def test_unknown_empty_and_missing_inputs_are_reported_not_raised(tmp_path):
    (tmp_path / "empty.log").write_text("")
    for name in ("unknown-notes.txt", "garbage.bin"):
        samples, rep = read(FIX / name)
        assert samples == [] and rep.format == "unknown" and rep.problems
    samples, rep = read(tmp_path / "empty.log")
    assert samples == [] and rep.problems == ["empty file"]
    files, missing = expand_inputs([tmp_path / "nope.jsonl", tmp_path])
    assert [m.problems for m in missing] == [["no such file or directory"]]
    assert files == [tmp_path / "empty.log"]


def test_a_gzip_that_is_not_gzip_inside_is_reported(tmp_path):
    p = tmp_path / "bad.jsonl.gz"
    p.write_bytes(b"\x1f\x8b" + b"\x00" * 50)
    samples, rep = read(p)
    assert samples == [] and rep.format == "unknown"
    assert "gzip" in rep.problems[0]


# ------------------------------------------------------------------------- SGLang logs


def test_0517_sweep_log_gives_true_step_times_per_configuration():
    samples, rep = read(FIX / "sglang-0.5.17-sweep.log")
    assert rep.format == "sglang-log" and not rep.problems
    assert {s.config for s in samples} == {OFF, S3}
    assert all(s.weight == 10 for s in samples)  # decode_log_interval from the server_args line
    assert rep.skipped["first interval of a server (spans start-up and idle time)"] == 2
    assert any("decode_log_interval 10" in n for n in rep.notes)
    by = {}
    for s in samples:
        by.setdefault((s.config, s.batch_size), []).append(s.step_ms)
    for (c, b), v in by.items():
        if len(v) >= 5:  # steady-state cells; the median is within noise of the truth
            assert np.median(v) == pytest.approx(true_ms(c, b), rel=0.05), (c, b)
    tau = np.mean([s.mean_accepted for s in samples if s.config == S3])
    assert tau + 1 == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.6, rel=0.05)
    assert all(s.mean_accepted is None for s in samples if s.config == OFF)


def test_0523_adaptive_log_drops_mixed_intervals_and_survives_damage():
    samples, rep = read(FIX / "sglang-0.5.23-adaptive-tp2.log")
    assert rep.format == "sglang-log" and not rep.problems
    assert rep.skipped["configuration changed inside the interval"] >= 5
    assert rep.skipped["truncated decode line (no gen throughput / #queue-req)"] == 1
    assert rep.skipped["unparseable decode line"] == 1
    assert rep.examples["configuration changed inside the interval"][0][1].startswith("[steps ")
    assert {s.config for s in samples} == {OFF, S1, S3}
    assert all(s.rank == 0 for s in samples)
    # every kept interval ran one configuration: its accept length is that configuration's
    for c, tau in ((S1, 1.8), (S3, 1 + 0.8 + 0.56 + 0.336)):
        m = np.mean([s.mean_accepted for s in samples if s.config == c])
        assert m + 1 == pytest.approx(tau, rel=0.06)
    assert max(s.mean_accepted for s in samples if s.config == S1) <= 1.0
    assert any("adaptive runtime state built for steps=1" in n for n in rep.notes)


def test_without_dropping_switch_intervals_the_accept_length_would_be_biased(tmp_path):
    g = sglang_gen
    from specctl.training import synth
    tr = synth.GroundTruth((synth.ConfigTruth(OFF, 6.0, 0.02), synth.ConfigTruth(S3, 7.6, 0.3, (0.9, 0.9, 0.9))))
    lines = g.simulate_log(tr, adaptive=True, levels=(8,), steps_per_level=3000, dwell=(10, 30), seed=5)
    samples, rep = read(write_log(tmp_path, lines))
    assert rep.skipped["configuration changed inside the interval"] > 20
    s3 = [s.mean_accepted for s in samples if s.config == S3]
    assert s3 and np.mean(s3) + 1 == pytest.approx(tr.configs[1].tokens_per_step(), rel=0.04)
    # the same log with the switch lines removed: the accept len / accept rate pair still names
    # the configuration at each line, and mixed intervals then poison the s3 acceptance
    stripped = [ln for ln in lines if "Switch adaptive" not in ln and "params updated" not in ln]
    samples2, rep2 = read(write_log(tmp_path, stripped, "stripped.log"))
    s3b = [s.mean_accepted for s in samples2 if s.config == S3]
    assert np.mean(s3b) < np.mean(s3) - 0.05


PREFIXES = [
    "[2026-11-29 12:00:00]",
    "[2026-11-29 12:00:00.250 TP0]",
    "[2026-11-29 12:00:00 DP1 TP0]",
    "[2026-11-29 12:00:00 DP0 PP1 TP0 EP0]",  # 0.5.23 order
    "[2026-11-29 12:00:00 DP0 TP0 EP0 PP1]",  # log_parser.py order
    "(SchedulerActor pid=4242, ip=10.0.0.7) [2026-11-29 12:00:00 TP0]",
]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("variant", ["plain", "iter", "suffix", "hybrid", "cpu"])
def test_decode_line_variants_parse(tmp_path, prefix, variant):
    g = sglang_gen
    def dec(n, thr):
        m = g.decode_msg(n, 1234, 0.12, (2.5, 0.5), thr, it=77 if variant == "iter" else None,
                         graph=True)
        if variant == "suffix":  # --enable-mfu-metrics / device timer suffixes
            m += ", est. decode TFLOPS/s (per GPU): 1.00, est. read BW (GB/s per GPU): 2.00"
        if variant == "hybrid":
            m = m.replace("#token: 1234, token usage: 0.12", "#full token: 10, full token usage: 0.01, "
                          "#swa token: 5, swa token usage: 0.02")
        if variant == "cpu":
            m = m.replace("cuda graph", "cpu graph")
        return f"{prefix} {m}"
    args = "server_args=" + g.server_args_msg("0.5.23", S3).split("server_args=", 1)[1]
    lines = [f"{prefix.split(']')[0].split('[')[0]}[2026-11-29 11:59:00] {args}", dec(8, 100.0), dec(8, 1000.0)]
    samples, rep = read(write_log(tmp_path, lines))
    assert len(samples) == 1, rep.to_obj()
    s = samples[0]
    assert s.config == S3 and s.batch_size == 8
    assert s.step_ms == pytest.approx(1000 * 8 * 2.5 / 1000.0)
    assert s.mean_accepted == pytest.approx(1.5)
    assert s.weight == 40


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
@pytest.mark.parametrize("config, adaptive", [(OFF, False), (S1, False), (S3, False), (S3, True),
                                              ((2, 4, 8), False)])
def test_server_args_lines_of_both_versions(version, config, adaptive):
    msg = sglang_gen.server_args_msg(version, config, adaptive=adaptive, decode_log_interval=25)
    a = parse_server_args(msg)
    assert a.config == config and a.adaptive == adaptive and a.decode_log_interval == 25
    assert (a.algorithm == "EAGLE3") == (config != OFF)


def test_switch_lines_set_the_configuration_without_server_args(tmp_path):
    g = sglang_gen
    p = "[2026-11-29 12:00:00 TP0]"
    lines = [f"{p} {g.decode_msg(4, 10, 0.1, (1.0, 0.0), 500.0)}",
             f"{p} {g.updated_msg(0, 3, 1.0)}",
             f"{p} {g.switch_msg(0, 3)}",
             f"{p} {g.decode_msg(4, 10, 0.1, (2.0, 0.33), 800.0)}",  # mixed: dropped
             f"{p} {g.decode_msg(4, 10, 0.1, (2.2, 0.4), 880.0)}",  # clean s3
             f"{p} {g.switch_msg(3, 1)}",
             f"{p} {g.decode_msg(4, 10, 0.1, (1.7, 0.7), 700.0)}",  # mixed
             f"{p} {g.decode_msg(4, 10, 0.1, (1.8, 0.8), 720.0)}"]  # clean s1
    samples, rep = read(write_log(tmp_path, lines))
    assert [s.config for s in samples] == [S3, S1]
    assert samples[0].step_ms == pytest.approx(1000 * 4 * 2.2 / 880)
    assert rep.skipped["configuration changed inside the interval"] == 2
    assert not any("tracked configuration" in n for n in rep.notes)


def test_configuration_inferred_from_accept_len_and_rate(tmp_path):
    g = sglang_gen
    p = "[2026-11-29 12:00:00]"
    lines = [f"{p} {g.decode_msg(4, 10, 0.1, (1.0, 0.0), 400.0)}",  # says nothing: skipped
             f"{p} {g.decode_msg(4, 10, 0.1, (1.0, 0.0), 400.0)}",
             f"{p} {g.decode_msg(4, 10, 0.1, (2.2, 0.4), 880.0)}",  # (2.2-1)/0.4 = 3 -> s3
             f"{p} {g.decode_msg(4, 10, 0.1, (1.0, 0.0), 400.0)}"]  # s3 accepting nothing
    samples, rep = read(write_log(tmp_path, lines))
    assert [(s.config, s.mean_accepted) for s in samples] == [(S3, pytest.approx(1.2)), (S3, 0.0)]
    assert rep.skipped["configuration unknown (no server_args / switch lines, accept len and rate "
                       "do not identify it)"] == 1
    assert any("inferred" in n for n in rep.notes)
    assert draft_widths_consistent(2.2, 0.4) is not None
    assert draft_widths_consistent(1.0, 0.0) is None
    # a server without speculation prints no accept fields at all
    lines = [f"{p} {g.decode_msg(4, 10, 0.1, None, 400.0)}"] * 2
    samples, rep = read(write_log(tmp_path, lines, "off.log"))
    assert [(s.config, s.step_ms) for s in samples] == [(OFF, 10.0)]


def test_a_missed_switch_is_caught_by_the_accept_rate(tmp_path):
    g = sglang_gen
    args = g.server_args_msg("0.5.17", S3)
    p = "[2026-11-29 12:00:00]"
    lines = [f"{p} {args}",
             f"{p} {g.decode_msg(4, 10, 0.1, (2.2, 0.4), 880.0)}",
             f"{p} {g.decode_msg(4, 10, 0.1, (1.8, 0.8), 720.0)}",  # draft width 2, not 4
             f"{p} {g.decode_msg(4, 10, 0.1, (1.8, 0.8), 720.0)}"]
    samples, rep = read(write_log(tmp_path, lines))
    assert rep.skipped["accept len / accept rate contradict the tracked configuration"] == 1
    assert [s.config for s in samples] == [S1]


def test_idle_start_and_batch_changes_are_dropped(tmp_path):
    g = sglang_gen
    p = "[2026-11-29 12:00:00]"
    d = lambda n, thr: f"{p} {g.decode_msg(n, 10, 0.1, None, thr)}"
    lines = [f"{p} {g.server_args_msg('0.5.23', None)}",
             d(8, 1000.0),                                   # first of the server
             d(8, 1000.0),                                   # used
             f"{p} {g.prefill_msg(1, 100, 0, 0.1)}",          # from an empty batch: idle before
             d(8, 100.0),                                    # spans idle
             d(16, 1500.0),                                  # batch grew 8 -> 16
             d(16, 1600.0)]                                  # used
    samples, rep = read(write_log(tmp_path, lines))
    assert [(s.batch_size, round(s.step_ms, 3)) for s in samples] == [(8, 8.0), (16, 10.0)]
    assert rep.skipped["interval spans an idle period (a prefill started from an empty batch)"] == 1
    assert rep.skipped["batch size changed inside the interval"] == 1
    assert rep.examples["batch size changed inside the interval"][0][1].startswith("[#running-req 8 -> 16]")


def test_prefill_time_inside_intervals_is_estimated_and_removed(tmp_path):
    g = sglang_gen
    from specctl.training import synth
    tr = synth.GroundTruth((synth.ConfigTruth(OFF, 6.0, 0.02),))
    lines = g.simulate_log(tr, static=OFF, levels=(16, 64), steps_per_level=3000, prefill_ms=5.0,
                           output_tokens=(64, 192), seed=9)
    samples, rep = read(write_log(tmp_path, lines))
    note = [n for n in rep.notes if "estimated at" in n]
    assert note, rep.notes
    for b in (16, 64):
        v = [s.step_ms for s in samples if s.batch_size == b]
        assert np.median(v) == pytest.approx(6.0 + 0.02 * b, rel=0.02)


def test_estimate_prefill_ms_recovers_a_known_cost():
    from specctl.training.costmodel import Sample
    rng = np.random.default_rng(0)
    items = []
    for b, t in ((8, 6.0), (32, 7.0)):
        for _ in range(40):
            n = int(rng.integers(0, 6))
            items.append((Sample(ts=0, config=OFF, batch_size=b, step_ms=t + 4.0 * n / 40), n / 40, 0.0))
    beta = estimate_prefill_ms(items)
    assert beta[0] == pytest.approx(4.0, rel=1e-6) and beta[1] == 0.0
    assert estimate_prefill_ms(items[:2]) is None


def test_progress_reports_the_bytes_read():
    seen = []
    list(read_file(FIX / "sglang-0.5.17-sweep.log", FileReport("x"), progress=seen.append))
    assert sum(seen) == (FIX / "sglang-0.5.17-sweep.log").stat().st_size


# ------------------------------------------------------------------------- bench_serving


def test_bench_serving_runs_become_samples_and_measured_points():
    samples, rep = read(FIX / "bench_serving-sweep.jsonl")
    assert rep.format == "bench-serving"
    assert rep.skipped == {"adaptive speculation: the configuration varied during the run": 1,
                           "no server_info (speculative settings unknown)": 1, "not JSON": 1}
    assert [e[0] for e in rep.examples["not JSON"]] == [10]
    assert len(samples) == 12 and len(rep.bench_points) == 12
    assert {(p.config, p.concurrency) for p in rep.bench_points} == {
        (c, k) for c in (OFF, S1, S3) for k in (1, 4, 16, 64)}
    for s in samples:
        expect = true_ms(s.config, s.batch_size) * (0.9 if (s.config, s.batch_size) == (S1, 16) else 1)
        assert s.step_ms == pytest.approx(expect, rel=1e-6)
        assert s.weight > 1
    assert len({s.server for s in samples}) == 12  # every run its own measurement


def test_bench_serving_pd_server_info_and_missing_accept_length(tmp_path):
    g = sglang_gen
    r = g.bench_result("0.5.17", S3, 8, step_ms=10.0, tau=2.5)
    r["server_info"] = {"decode": [r["server_info"]], "prefill": [{}]}
    r2 = g.bench_result("0.5.17", S3, 16, step_ms=12.0, tau=2.5)
    r2["accept_length"] = None
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps(r) + "\n" + json.dumps(r2) + "\n")
    samples, rep = read(p)
    assert [s.batch_size for s in samples] == [8]
    assert len(rep.bench_points) == 2  # the run without accept_length still counts as measured
    assert any("no accept_length" in n for n in rep.notes)


def test_bench_serving_batch_capped_by_max_running_requests(tmp_path):
    g = sglang_gen
    r = g.bench_result("0.5.23", S3, 128, step_ms=20.0, tau=2.5)
    r["server_info"]["max_running_requests"] = 48  # SGLang's default with speculation
    p = tmp_path / "b.jsonl"
    p.write_text(json.dumps(r) + "\n")
    samples, rep = read(p)
    assert samples[0].batch_size == 48 and rep.bench_points[0].concurrency == 128
    assert any("max_running_requests 48" in n for n in rep.notes)


# ------------------------------------------------------------------------- telemetry


def test_telemetry_recording_bad_records_reported_with_line_numbers():
    samples, rep = read(FIX / "telemetry-synth.jsonl.gz")
    assert rep.format == "telemetry" and not rep.problems
    assert len(samples) == 2400 and rep.num_used == 2400
    assert dict(rep.skipped) == {"bad_json": 1, "bad_schema_version": 1, "bad_value": 1,
                                 "unknown_field": 1}
    assert rep.examples["bad_json"][0][0] == 11
    assert rep.examples["unknown_field"][0][0] == 41
    s = samples[0]
    assert s.weight == 1 and s.server == "synth-0" and (s.accepted is not None or s.config == OFF)


def test_truncated_gzip_keeps_what_came_before():
    samples, rep = read(FIX / "telemetry-truncated.jsonl.gz")
    assert rep.format == "telemetry"
    assert len(samples) > 500
    assert len(rep.problems) == 1 and "truncated" in rep.problems[0]


def test_plain_jsonl_with_a_cut_last_line(tmp_path):
    lines = (gzip.decompress((FIX / "telemetry-synth.jsonl.gz").read_bytes()).decode().splitlines())[:50]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n" + lines[60 % len(lines)][:37])
    samples, rep = read(p)
    assert rep.format == "telemetry"
    assert rep.skipped["bad_json"] == 2
    assert any("cut while being written" in n for n in rep.notes)


def test_a_huge_garbage_line_is_skipped_not_loaded(tmp_path, monkeypatch):
    import specctl.training.lines as lines  # iter_lines, which every reader reads through
    monkeypatch.setattr(lines, "MAX_LINE_BYTES", 1000)
    recs = gzip.decompress((FIX / "telemetry-synth.jsonl.gz").read_bytes()).decode().splitlines()[:20]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(recs[:5] + ["x" * 5000] + recs[5:]) + "\n")
    samples, rep = read(p)
    assert rep.skipped["line_too_long"] == 1 and rep.examples["line_too_long"][0][0] == 6
    assert len(samples) == 19


# ------------------------------------------------------------------------- SGLang's own code



@pytest.mark.sglang_sources
@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_lines_from_sglangs_own_reporter_code(tmp_path, version):
    """report_decode_stats / report_prefill_stats and the switch f-strings, lifted from the wheel
    (scripts/setup_sglang_cpu.sh's venvs) and run on stand-ins: what the reader gets back is the
    scripted step time, with the interval that switched configuration dropped."""
    real = sglang_real
    src = real.find_sources(version)
    if src is None:
        pytest.skip(f"needs the sources of sglang {version} under .cache/ (`make test` installs them first)")
    g = sglang_gen
    rep_ = real.Reporter(src, spec_steps=3, draft_tokens=4, interval=10)
    pre = "[2026-11-29 12:00:00 TP0]"
    out = [f"[2026-11-29 11:59:00] {g.server_args_msg(version, S3, adaptive=True, decode_log_interval=10)}"]
    out += [f"{pre} {m}" for m in rep_.prefill(8, 800, 0, 20.0)]
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [12] * 10, 11.0)]  # first: dropped
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [12] * 10, 11.0)]  # s3 at 11 ms
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [12] * 4, 11.0)]
    out.append(f"{pre} {real.updated_line(src, 3, 1, 1.4)}")
    out.append(f"{pre} {real.switch_line(src, (3, 4), (1, 2))}")
    rep_.set_draft_tokens(1, 2)
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [6] * 6, 8.0)]  # mixed: dropped
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [6] * 10, 8.0)]  # s1 at 8 ms
    out += [f"{pre} {m}" for m in rep_.decode_steps(8, [6] * 10, 8.0)]
    assert sum("Decode batch" in ln for ln in out) == 5
    samples, rep = read(write_log(tmp_path, out))
    assert rep.skipped["configuration changed inside the interval"] == 1
    assert rep.skipped["first interval of a server (spans start-up and idle time)"] == 1
    assert [(s.config, round(s.step_ms, 2)) for s in samples] == [(S3, 11.0), (S1, 8.0), (S1, 8.0)]
    assert samples[0].mean_accepted == pytest.approx(1.5, abs=0.01)
    assert samples[1].mean_accepted == pytest.approx(0.75, abs=0.01)
    # plain decode server: no accept fields at all
    off = real.Reporter(src, interval=10)
    lines = [f"{pre} {m}" for m in off.decode_steps(16, [0] * 20, 6.5)]
    samples, rep = read(write_log(tmp_path, lines, "off.log"))
    assert [(s.config, round(s.step_ms, 2)) for s in samples] == [(OFF, 6.5)]


@pytest.mark.sglang_sources
@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_the_fixture_generator_writes_what_sglang_writes(version):
    real = sglang_real
    src = real.find_sources(version)
    if src is None:
        pytest.skip(f"needs the sources of sglang {version} under .cache/ (`make test` installs them first)")
    g = sglang_gen
    r = real.Reporter(src, spec_steps=3, draft_tokens=4, interval=5)
    got = r.decode_steps(6, [4, 5, 6, 7, 8], 9.0, tokens_in_use=4321, usage=0.37)
    thr = (5 * 6 + 30) / 0.045
    assert got == [g.decode_msg(6, 4321, 0.37, (60 / 30, 30 / (30 * 3)), thr)]
    # input throughput counts from the previous prefill line: 45 ms of decode + 2 ms of prefill
    assert r.prefill(3, 456, 6, 2.0) == [g.prefill_msg(3, 456, 6, 0.37, input_tput=456 / 0.047)]
    assert real.switch_line(src, (0, 1), (3, 4)) == g.switch_msg(0, 3)
    assert real.updated_line(src, 0, 3, 2.5) == g.updated_msg(0, 3, 2.5)
