"""run_bench's --mem-fraction fit:GB: each server's --mem-fraction-static from the memory free when it starts, the
servers of a group starting one after another (how several 20 GB MoE servers share one GPU)."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402

GPU = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")


@pytest.mark.parametrize("text, want", [
    ("0", ("fixed", 0.0)), ("0.42", ("fixed", 0.42)), ("fit:3", ("fit", 3.0)), ("fit:0.5", ("fit", 0.5)),
])
def test_the_fraction_is_a_number_or_fit(text, want):
    assert B.parse_mem_fraction(text) == want


@pytest.mark.parametrize("text, message", [
    ("1.2", "must be in"), ("-0.1", "must be in"), ("fit:0", "GB > 0"), ("fit:x", "could not convert"),
    ("half", "could not convert"),
])
def test_a_bad_fraction_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message):
        B.parse_mem_fraction(text)


@pytest.mark.parametrize("free, load, extra, want", [
    (79.0, 20.8, 3.0, 0.302),   # the first MoE server on an empty H100
    (53.0, 20.8, 3.0, 0.45),   # the second: its fraction is of what the first left
    (27.0, 20.8, 3.0, 0.882),   # the third
    (139.0, 20.8, 3.0, 0.172),  # an H200
])
def test_the_fraction_covers_the_weights_and_the_extra_of_what_is_free(free, load, extra, want):
    f = B.fit_fraction(free, load, extra)
    assert f == want
    assert f * free - load >= extra - 0.01  # SGLang's KV budget after loading: fraction x free-before - weights


def test_a_server_that_cannot_fit_is_refused_before_it_starts():
    with pytest.raises(ValueError, match="cannot hold 20.8 GB of weights"):
        B.fit_fraction(22.0, 20.8, 3.0)
    with pytest.raises(ValueError, match="cannot hold"):
        B.fit_fraction(0.0, 1.0, 1.0)


def test_the_free_memory_is_that_of_the_visible_gpu():
    smi = "0, 81000\n1, 40960\n"
    assert B.gpu_free_gb(smi) == pytest.approx(81000 / 1024)
    assert B.gpu_free_gb(smi, "1") == 40.0 and B.gpu_free_gb(smi, "1,0") == 40.0
    with pytest.raises(ValueError, match="GPU '3'"):
        B.gpu_free_gb(smi, "3")


def test_the_weights_are_the_safetensors_of_the_model_and_draft(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "m" / "model-00001.safetensors").write_bytes(b"\0" * 2 ** 20)
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\0" * 2 ** 19)
    assert B.weights_gb(str(tmp_path / "m")) == pytest.approx(1 / 1024)
    assert B.weights_gb(str(tmp_path / "m"), str(tmp_path / "d"), None) == pytest.approx(1.5 / 1024)


@pytest.mark.slow
def test_fitted_servers_start_one_after_another_each_from_what_is_left(tmp_path, bench_prompts, port0):
    """Against the stand-in server, with an nvidia-smi stand-in whose free memory is 60, 36, 12, then 60 GB again
    (the first group gone): each server gets its own fraction in launch order; the third does not fit beside the
    first two and starts in a group of its own."""
    pytest.importorskip("aiohttp")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "queries"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$*\" in *memory.free*)\n"
                   f"  n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}\n"
                   f"  case $n in 0) g=60;; 1) g=36;; 2) g=12;; *) g=60;; esac; echo \"0, $((g * 1024))\";;\n"
                   f"*) echo 'Stand-in GPU';; esac\n")
    smi.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(20 * 2 ** 30)  # 20 GB of weights, sparse: nothing written
    out = tmp_path / "rb"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="0",
               PYTHONPATH=os.path.join(GPU, "mock") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pols = ["off", "static:s1", "static:s3"]
    cmd = [sys.executable, os.path.join(GPU, "run_bench.py"), "--model", str(model), "--variant", "mock",
           "--draft", "/d", "--policies", ",".join(pols), "--levels", "1", "--new-tokens", "16",
           "--req-per-level", "2", "--identity-c", "1", "--identity-tokens", "4", "--parallel", "3",
           "--mem-fraction", "fit:3", "--deadline-s", "200", "--out", str(out), "--prompts", bench_prompts,
           "--tokenizer", "simple", "--specctl-site", str(tmp_path / "site"), "--port0", port0]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.load(open(out / "bench-mock.json"))
    frac = {p: bench["servers"][p]["cmd"].split("--mem-fraction-static ")[1].split()[0] for p in pols}
    assert frac == {"off": "0.384", "static:s1": "0.639", "static:s3": "0.384"}, frac  # (20 + 3) / free
    assert "not launched static:s3 ValueError: 12.0 GB free cannot hold 20.0 GB" in r.stdout
    assert r.stdout.index("launched off") < r.stdout.index("launched static:s1") < r.stdout.index("launched static:s3")
    assert all(bench["servers"][p]["ready"] for p in pols)


TAIL_MOE = {"num_hidden_layers": 126, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
DRAFT = {"num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "hidden_size": 576}


@pytest.mark.parametrize("cfgs, tokens, want_bytes", [
    ([TAIL_MOE], 1, 126 * 3 * 64 * 2 * 2),            # layers x KV heads x head dim x (K, V) x bf16
    ([TAIL_MOE, DRAFT], 1, 127 * 3 * 64 * 2 * 2),     # the draft's one layer besides
    ([{"num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576}], 2, 2 * 30 * 9 * 64 * 4),  # MHA
    ([None], 1000, 0),                                 # no config: nothing counted
])
def test_the_kv_of_a_token_is_each_models_layers_heads_and_head_dim(tmp_path, cfgs, tokens, want_bytes):
    dirs = []
    for i, c in enumerate(cfgs):
        d = tmp_path / f"m{i}"
        d.mkdir()
        if c is not None:
            (d / "config.json").write_text(json.dumps(c))
        dirs.append(str(d))
    assert B.kv_gb(tokens, *dirs) * 2 ** 30 == pytest.approx(want_bytes)


def test_a_kv_cap_the_fit_cannot_hold_is_refused_before_any_server_starts(tmp_path, bench_prompts):
    """fit:3 with 60000 tokens of the tail MoE's KV (5.5 GB): SGLang would size a smaller pool and queue requests
    at the top levels, so run_bench refuses, naming the figures; 30000 tokens (2.7 GB) would pass this check."""
    model, draft = tmp_path / "moe", tmp_path / "draft"
    for d, c in ((model, TAIL_MOE), (draft, DRAFT)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
    assert B.kv_gb(30000, str(model), str(draft)) < 3 < B.kv_gb(60000, str(model), str(draft))
    cmd = [sys.executable, os.path.join(GPU, "run_bench.py"), "--model", str(model), "--variant", "moe",
           "--draft", str(draft), "--policies", "off", "--levels", "1", "--mem-fraction", "fit:3",
           "--max-total-tokens", "60000", "--out", str(tmp_path / "rb"), "--prompts", bench_prompts,
           "--tokenizer", "simple", "--specctl-site", str(tmp_path / "site")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--max-total-tokens 60000: this model's and its draft's KV take 5.5 GB, more than fit:3" in r.stderr
    assert "give fit:6 or fewer tokens" in r.stderr
    assert not (tmp_path / "rb" / "bench-moe.json").exists()
