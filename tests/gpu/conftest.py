"""Fixtures of the GPU testbed's CPU tests."""
import gzip
import json
import os

import pytest


@pytest.fixture
def bench_prompts(tmp_path):
    """A prompts folder in the layout run_bench.py and ctx_profile.py read (MT-Bench questions and
    HumanEval problems), 12 of each, for runs against the stand-in server."""
    d = str(tmp_path / "prompts")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "mtbench_question.jsonl"), "w") as f:
        for i in range(12):
            f.write(json.dumps({"question_id": i, "turns": [f"Write a short note number {i} about the sea."]}) + "\n")
    with gzip.open(os.path.join(d, "HumanEval.jsonl.gz"), "wt") as f:
        for i in range(12):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    '''Return x plus {i}.'''\n"}) + "\n")
    return d
