"""`specctl bench sim` end to end through click: the table, the JSON record, the plot, user errors."""

import json

import pytest
from click.testing import CliRunner

from specctl.controller.cli import main

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
