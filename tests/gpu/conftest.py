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


@pytest.fixture
def port0():
    """A `--port0` for run_bench.py / ctx_profile.py (servers on port0 + 10 k, k < 10) below the
    kernel's ephemeral range (32768+ here), where a client connection's source port can take a fixed
    port between the check and the server's bind; each xdist worker its own 2000 ports."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    idx = int(worker[2:]) if worker[2:].isdigit() else 0
    for _ in range(50):
        base = 20000 + 2000 * (idx % 6) + 100 * random.randrange(20)
        try:
            for k in range(10):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + 10 * k))
            return str(base)
        except OSError:
            continue
    raise RuntimeError("no free block of ports below the ephemeral range")
