"""run_bench.py --open-loop's pieces: the ShareGPT file SGLang's client (`python -m sglang.bench_serving`) reads, its
command, and the summary of its runs. The client itself needs transformers and the rest of SGLang's benchmark
dependencies, which no CPU environment here has: the GPU testbed runs it (docs/testbed.md)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402
import prompts as P  # noqa: E402
import run_bench as RB  # noqa: E402


class BosTokenizer(P.SimpleTokenizer):
    """encode() adds a BOS, as many HF tokenizers do: the file's replies must still count what the loader counts."""

    def encode(self, text):
        return [1] + super().encode(text)


def test_sharegpt_file_replies_have_the_spread_caps_token_counts(tmp_path):
    items = [{"id": "a", "text": "Tell me about the sea."}, {"id": "b", "text": "def f(x): return x"}]
    for tok in (P.SimpleTokenizer(), BosTokenizer()):
        rows = json.load(open(RB.sharegpt_file(str(tmp_path / "d.json"), items, tok, 7, 40, 10)))
        assert len(rows) == 7 and len({r["id"] for r in rows}) == 7
        assert [r["conversations"][0]["value"] for r in rows[:3]] == [items[0]["text"], items[1]["text"], items[0]["text"]]
        assert [r["conversations"][0]["from"] for r in rows] == ["human"] * 7
        assert [len(tok.encode(r["conversations"][1]["value"])) for r in rows] == \
            [B.spread_tokens(40, 10, k) for k in range(7)]


def test_bench_serving_command_is_sglangs_open_loop_client_on_a_local_file():
    cmd = RB.bench_serving_cmd("py", 31010, "/m", "/t", "/d.json", 12.5, 375, "/o.jsonl")
    assert cmd[:3] == ["py", "-m", "sglang.bench_serving"]
    flags = {"--apply-chat-template", "--disable-tqdm"}
    rest = [x for x in cmd[3:] if x not in flags]
    args = dict(zip(rest[::2], rest[1::2]))
    assert all(k.startswith("--") for k in args)
    assert args["--backend"] == "sglang" and args["--dataset-name"] == "sharegpt" and args["--dataset-path"] == "/d.json"
    assert args["--request-rate"] == "12.5" and args["--num-prompts"] == "375" and args["--port"] == "31010"
    assert flags <= set(cmd) and args["--ready-check-timeout-sec"] == "0"


def test_datasets_stand_in_refuses_any_hub_load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ds", os.path.join(RB.OPENLOOP_SHIM, "datasets", "__init__.py"))
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    try:
        ds.load_dataset("lmms-lab/MMMU")
    except RuntimeError as e:
        assert "--dataset-path" in str(e)
    else:
        raise AssertionError("load_dataset returned")


def test_open_loop_summary_takes_the_median_run_per_server_and_rate():
    def run(pol, rate, tps, ttft):
        return {"policy": pol, "rate": rate, "output_throughput": tps, "median_ttft_ms": ttft, "completed": 10}
    rows = [run("off", 4.0, 100, 50), run("off", 4.0, 120, 40), run("off", 4.0, 110, 70),
            run("specctl", 4.0, 130, 30), {"policy": "specctl", "rate": 8.0, "error": "bench_serving exited 1"},
            run("off", 8.0, 200, 90)]
    s = {(x["policy"], x["rate"]): x for x in RB.open_loop_summary(rows)}
    assert s[("off", 4.0)]["output_throughput"] == 110 and s[("off", 4.0)]["median_ttft_ms"] == 70
    assert s[("off", 4.0)]["median_ttft_ms_median"] == 50 and s[("off", 4.0)]["runs"] == 3
    assert s[("off", 4.0)]["repeats_output_throughput"] == [100, 120, 110]
    assert s[("specctl", 8.0)] == {"policy": "specctl", "rate": 8.0, "runs": 1, "error": "bench_serving exited 1"}
    assert [(x["policy"], x["rate"]) for x in RB.open_loop_summary(rows)] == \
        [("off", 4.0), ("specctl", 4.0), ("off", 8.0), ("specctl", 8.0)]
