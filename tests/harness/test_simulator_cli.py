"""`specctl bench sim` end to end through click: the table, the JSON record, the plot, user errors."""

import json

import pytest
from click.testing import CliRunner

from specctl.harness.cli import main

WORKLOAD = {"schema": "specctl.workload/1", "seed": 2,
            "classes": {"code": {"accept": {"s1": [0.85], "s3": [0.85, 0.8, 0.75]}, "output_tokens": [64, 128]},
                        "chat": {"accept": {"s1": [0.6], "s3": [0.6, 0.5, 0.4]}, "output_tokens": [32, 64]}},
            "phases": [{"name": "low", "duration_s": 4, "concurrency": 2, "mix": {"code": 1.0}},
                       {"name": "high", "duration_s": 4, "concurrency": 48, "mix": {"chat": 1.0}}]}


@pytest.fixture
def workload(tmp_path):
    p = tmp_path / "w.json"
    p.write_text(json.dumps(WORKLOAD))
    return p


def test_bench_sim_prints_and_records(tmp_path, workload):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(main, ["bench", "sim", "--profile", "moe-1t-int4-tp8-pcie", "--workload", str(workload),
                                    "--json", str(out), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    assert "x oracle" in res.output and "per phase" in res.output
    rec = json.loads(out.read_text())
    names = [r["policy"] for r in rec["results"]]
    assert {"off", "static:s1", "static:s3", "sglang-ema", "adaptive", "oracle"} <= set(names)
    assert any(n.startswith("best-static=") for n in names) and any(n.startswith("best-threshold=") for n in names)
    for r in rec["results"]:
        assert {"policy", "tokens_per_s", "oracle_ratio", "phases"} <= set(r)
        assert [p["name"] for p in r["phases"]] == ["low", "high"]
        assert r["oracle_ratio"] <= 1.002
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, fragment", [
    (["--profile", "nope", "--workload", "ramp"], "nope: no such file, and no shipped profile"),
    (["--profile", "dense-8b-h200", "--workload", "ramp", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["--profile", "dense-8b-h200", "--workload", "ramp", "--policy", "static:s7"], "'s7' = (7, 1, 8) is not in the profile"),
    (["--profile", "dense-8b-h200", "--workload", "ramp", "--policy", "adaptive:speed=9"], "'speed' is not a controller setting"),
    (["--profile", "dense-8b-h200"], "--profile and --workload are required"),
])
def test_bench_sim_user_errors_are_messages(args, fragment):
    res = CliRunner().invoke(main, ["bench", "sim", *args])
    assert res.exit_code == 2, res.output
    assert fragment in res.output
    assert "Traceback" not in res.output


def test_bench_sim_bad_file_is_a_message(tmp_path):
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({**WORKLOAD, "phases": [{"duration_s": 5, "mix": {"code": 1}}]}))
    res = CliRunner().invoke(main, ["bench", "sim", "--profile", "dense-8b-h200", "--workload", str(bad)])
    assert res.exit_code == 2
    assert "phases[0] needs exactly one of 'concurrency' (closed loop) or 'arrival_rate'" in res.output


# --------------------------------------------------------------------------- specctl demo


def test_demo_help_names_the_default_scenario_and_the_shipped_files():
    res = CliRunner().invoke(main, ["demo", "--help"], terminal_width=400)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "[default: h100-sglang-smollm2-135m-moe-triton-specctl]" in text and "[default: code-chat-ramp]" in text
    for name in ("moe-1t-int4-tp8-pcie", "dense-8b-h200", "h200-smollm2-135m", "stationary-low", "demo"):
        assert name in text  # the other shipped profiles and workloads are listed


@pytest.mark.slow
def test_demo_runs_live_and_says_one_verdict_against_the_operators_threshold(tmp_path, workload):
    # the short two-phase workload above, on the default (measured) MoE profile: the real daemon comes up,
    # the live engine runs 8 s against it, the virtual-clock baselines follow
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    res = CliRunner().invoke(main, ["demo", "--workload", str(workload), "--plot", str(png), "--json", str(out)])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    verdicts = [ln for ln in lines if ln.startswith("verdict:")]
    assert len(verdicts) == 1 and lines[-1] == verdicts[0], res.output  # the last line, for scripts
    v = verdicts[0]
    # the verdict first: a few lines of progress (one per phase off a terminal), then the headline,
    # the other ratios, and only then the details
    head = next(i for i, ln in enumerate(lines) if ln.startswith("specctl ") and " tok/s = " in ln)
    assert head <= 8, res.output
    assert sum(ln.startswith("[") and " tok/s  policy" in ln for ln in lines[:head]) == 2  # two phases
    for ref in ("x off (no speculation", "x SGLang's adaptive", "x the oracle"):
        assert ref in lines[head + 1], lines[head + 1]
    details = lines.index(next(ln for ln in lines if ln.startswith("details:")))
    table = next(i for i, ln in enumerate(lines) if "x oracle" in ln)
    assert head < details < table and "\x1b[" not in res.output  # plain off a terminal
    for ref in ("x the operator's threshold:5:s3", "x sglang-ema", "x off", "x the best static (", "x the oracle"):
        assert ref in v, v
    rec = json.loads(out.read_text())
    by = {r["policy"]: r for r in rec["results"]}
    assert {"off", "static:s1", "static:s2", "static:s3", "threshold:5:s3", "sglang-ema", "adaptive",
            "adaptive-live", "oracle"} == set(by)
    assert rec["profile"] == "h100-sglang-smollm2-135m-moe-triton-specctl" and rec["verdict"] == v
    live = by["adaptive-live"]["tokens_per_s"]
    assert live > 0 and by["adaptive-live"]["num_steps"] > 20  # it did decode, paced to the wall clock
    ratio = live / by["threshold:5:s3"]["tokens_per_s"]
    assert f"{ratio:.3f}x the operator's threshold:5:s3" in v  # the line states the record's figures
    assert lines[head] == f"specctl {live:.1f} tok/s = {ratio:.3f}x the operator's threshold:5:s3"
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_verdict_states_every_ratio_and_legends_say_what_a_policy_does():
    from specctl.harness import simbench
    from specctl.training.simulator import load_profile, parse_workload

    prof, wl = load_profile("moe-1t-int4-tp8-pcie"), parse_workload(WORKLOAD)
    rep = simbench.run_bench(prof, wl, ["off", "static:s1", "static:s3", "threshold:5:s3", "oracle"], search=False)
    by = {r.policy: r.tokens_per_s for r in rep.results}
    v = simbench.verdict(rep, "threshold:5:s3", "threshold:5:s3", label="X")
    best = max(("off", "static:s1", "static:s3"), key=by.get)
    assert v.startswith(f"verdict: X {by['threshold:5:s3']:.1f} tok/s = 1.000x the operator's threshold:5:s3, ")
    assert f"{by['threshold:5:s3'] / by['off']:.3f}x off" in v
    assert f"{by['threshold:5:s3'] / by[best]:.3f}x the best static ({best})" in v
    assert "sglang-ema" not in v  # a reference that did not run is left out, not invented
    assert simbench.describe_policy("off") == "off: plain decode (no speculation)"
    assert simbench.describe_policy("threshold:5:s3") == \
        "threshold:5:s3: 3 draft steps (s3) below batch 5, plain decode from 5"
    assert simbench.describe_policy("best-static=static:s1") == "best static = static:s1: always 1 draft step (s1)"


@pytest.mark.parametrize("name, short, long", [
    ("h100-sglang-smollm2-135m-moe-triton-specctl", "measured profile h100-sglang-smollm2-135m-moe-triton-specctl",
     "measured profile h100-sglang-smollm2-135m-moe-triton-specctl (H100, SGLang 0.5.17 triton, MoE test target "
     "(128 experts, top-8), draft v2)"),
    ("moe-1t-int4-tp8-pcie", "synthetic profile moe-1t-int4-tp8-pcie", None),
    ("h200-smollm2-135m", "profile h200-smollm2-135m", "profile h200-smollm2-135m"),
])
def test_the_demo_names_a_profile_by_what_its_note_says_it_is(name, short, long):
    from specctl.harness.cli_bench import _profile_words
    from specctl.training.simulator import load_profile

    got = _profile_words(name, load_profile(name))
    assert got[0] == short
    if long is not None:
        assert got[1] == long
    else:
        assert got[1].startswith(short + " (") and got[1].endswith("modelled, not measured)")
