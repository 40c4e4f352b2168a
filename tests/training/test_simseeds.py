"""scripts/simseeds.py: two controller variants compared over seeds from simtargets --json files."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
_spec = importlib.util.spec_from_file_location("simseeds", os.path.join(ROOT, "scripts", "simseeds.py"))
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)

P, Q = ("p", "w1"), ("p", "w2")


@pytest.mark.parametrize("base, var, single, avg_below", [
    # identical runs: nothing below
    ([{P: 0.99, Q: 0.98}], [{P: 0.99, Q: 0.98}], 0, []),
    # one seed 1 % below on P, the other 1 % above: below at a single seed, not in the average
    ([{P: 0.99, Q: 0.98}, {P: 0.98, Q: 0.98}], [{P: 0.98, Q: 0.98}, {P: 0.99, Q: 0.98}], 1, []),
    # both seeds 0.6 % below on Q: below in both and in the average
    ([{P: 0.99, Q: 0.99}, {P: 0.99, Q: 0.99}], [{P: 0.99, Q: 0.984}, {P: 0.99, Q: 0.984}], 2, [[list(Q), -0.006]]),
    # 0.4 % below: within the tolerance
    ([{P: 0.99, Q: 0.99}], [{P: 0.986, Q: 0.99}], 0, []),
])
def test_single_seed_and_seed_averaged_pairs_below(base, var, single, avg_below):
    r = S.compare(base, var)
    assert len(r["single_seed_below"]) == single
    assert r["seed_avg_below"] == avg_below
    assert r["seeds"] == len(base) and r["pairs"] == 2


def test_means_and_minimum():
    r = S.compare([{P: 1.0, Q: 0.98}, {P: 0.96, Q: 0.98}], [{P: 0.99, Q: 0.99}, {P: 0.99, Q: 0.97}])
    assert r["base_mean_per_seed"] == [0.99, 0.97] and r["variant_mean_per_seed"] == [0.99, 0.98]
    assert r["base_mean"] == 0.98 and r["variant_mean"] == 0.985
    assert r["base_min"] == 0.96 and r["variant_min"] == 0.97


def test_mismatched_runs_are_refused():
    with pytest.raises(ValueError, match="one variant run per base run"):
        S.compare([{P: 1.0}], [{P: 1.0}, {P: 1.0}])
    with pytest.raises(ValueError, match="other pairs"):
        S.compare([{P: 1.0}], [{Q: 1.0}])


def test_the_command_reads_simtargets_files_and_writes_its_record(tmp_path):
    def rows(policy, vals):
        return [{"profile": p, "workload": w, "policy": policy, "oracle": v} for (p, w), v in vals.items()]

    a, b = tmp_path / "s7.json", tmp_path / "s11.json"
    a.write_text(json.dumps(rows("adaptive", {P: 0.99, Q: 0.98}) + rows("adaptive:x=1", {P: 0.98, Q: 0.98})))
    b.write_text(json.dumps(rows("adaptive", {P: 0.99, Q: 0.98}) + rows("adaptive:x=1", {P: 0.985, Q: 0.98})))
    out = tmp_path / "cmp.json"
    run = [sys.executable, os.path.join(ROOT, "scripts", "simseeds.py"), "--base", "adaptive", str(a), str(b),
           "--variant", "adaptive:x=1", str(a), str(b), "--json", str(out)]
    p = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "pairs > 0.5% below the base at single seeds: 2 of 4" in p.stdout
    r = json.loads(out.read_text())
    assert r["seed_avg_below"] == [[list(P), -0.0075]] and r["variant_policy"] == "adaptive:x=1"
    # a policy the file does not hold: a clear error naming it
    p = subprocess.run(run[:3] + ["nope", str(a)] + run[5:9], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "no rows of policy 'nope'" in p.stderr
