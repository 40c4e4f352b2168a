"""benchmarks/gpu/tensor_dump.py's comparison of two servers' tensor dumps (SGLang's TensorDumper files: one
dict of module name -> tensor per forward pass), on CPU; torch comes with the sglang environments."""

import os
import sys

import pytest

pytestmark = pytest.mark.sglang
torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import tensor_dump as T  # noqa: E402


def _pass(path, pos, layers, logits=None):
    d = {"model.forward_batch_info.positions": torch.tensor(pos)}
    for k, v in layers.items():
        d[k] = v
    if logits is not None:
        d["logits_processor"] = logits
    torch.save(d, path)
    return str(path)


def test_passes_match_by_position_and_the_first_differing_module_is_named(tmp_path):
    h = torch.randn(3, 8, dtype=torch.bfloat16)
    mlp = torch.randn(3, 16, dtype=torch.bfloat16)
    off = [_pass(tmp_path / "a0.pt", [0, 1, 2], {"model.layers.0.self_attn.o_proj": h, "model.layers.0.mlp": mlp}),
           _pass(tmp_path / "a1.pt", [3], {"model.layers.0.self_attn.o_proj": h[:1], "model.layers.0.mlp": mlp[:1]})]
    moved = h[:1].clone()
    moved[0, 5] += 0.0625
    ds = [_pass(tmp_path / "b1.pt", [3], {"model.layers.0.self_attn.o_proj": moved, "model.layers.0.mlp": mlp[:1] * 2}),
          _pass(tmp_path / "b0.pt", [0, 1, 2], {"model.layers.0.self_attn.o_proj": h, "model.layers.0.mlp": mlp}),
          _pass(tmp_path / "b9.pt", [7], {"model.layers.0.mlp": mlp[:1]})]  # no such pass in the other server
    rows = T.compare_passes(off, ds)
    assert [r["positions"] for r in rows] == [[3, 3], [0, 2]]
    step, prefill = rows
    assert prefill["differing"] == 0 and prefill["first_differing"] is None
    assert step["first_differing"] == "model.layers.0.self_attn.o_proj" and step["differing"] == 2
    assert step["first_diff"] == pytest.approx(0.0625, abs=0.02)  # bf16 rounding of the moved value


def test_shapes_ints_and_missing_modules_are_reported(tmp_path):
    a = _pass(tmp_path / "a.pt", [4, 5], {"x": torch.zeros(2, 4), "ids": torch.tensor([1, 2]), "only_off": torch.ones(1)})
    b = _pass(tmp_path / "b.pt", [4, 5], {"x": torch.zeros(3, 4), "ids": torch.tensor([1, 3])})
    r = T.compare_pass(a, b)
    assert r["diffs"]["x"] == "shape (2, 4) vs (3, 4)" and r["diffs"]["ids"] == 1.0
    assert r["missing_in_decode_state"] == ["only_off"] and r["first_differing"] == "x"



_DUMPER_CHECK = r"""
import sys, torch
from sglang.srt.debug_utils.tensor_dump_forward_hook import TensorDumper
d = TensorDumper(sys.argv[1], None, 1, 0, 0)
h, aux = torch.ones(2, 4), [torch.zeros(2, 4), torch.full((2, 4), 2.0)]
try:
    d.add_tensor("model", (h, aux))  # an EAGLE-3 target's LlamaModel output with the hidden-state capture on
except AttributeError as e:
    print("FAILS", e)
    raise SystemExit(0)
got = d._current_tensors["model"]
print("OK", len(got), [float(t.sum()) for t in got])
d.add_tensor("model.layers.0.mlp", (h, None))  # SGLang's own cases stay SGLang's
print("PLAIN", tuple(d._current_tensors["model.layers.0.mlp"].shape))
"""


def _sglang_dumper_tree(root):
    """The installed sglang's own tensor_dump_forward_hook.py under a bare sglang/srt/debug_utils/ package in root,
    its two imports of SGLang's batch types (which pull in transformers, absent from the CPU environments) made
    local classes: SGLang's dumper code, importable by name, without the rest of sglang."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    src_path = os.path.join(os.path.dirname(spec.origin), "srt", "debug_utils", "tensor_dump_forward_hook.py")
    src = open(src_path).read()
    stubs = {"from sglang.srt.layers.logits_processor import LogitsProcessorOutput":
             "class LogitsProcessorOutput: pass",
             "from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors":
             "class ForwardBatch: pass\nclass PPProxyTensors: pass"}
    for line, repl in stubs.items():
        assert line in src, f"{src_path} no longer imports {line!r}: update the stubs"
        src = src.replace(line, repl)
    pkg = root / "sglang" / "srt" / "debug_utils"
    pkg.mkdir(parents=True)
    for d in (root / "sglang", root / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "tensor_dump_forward_hook.py").write_text(src)
    return str(root)


def test_the_testbed_site_lets_sglangs_tensor_dump_take_an_eagle3_targets_output(tmp_path):
    """tdump_site/sitecustomize.py in a fresh interpreter, on SGLang's own TensorDumper: the (hidden, [aux])
    output is kept as one list of tensors, the hidden states first, and SGLang's own cases are untouched; without
    the site SGLang's dumper fails on that output (0.5.17, 0.5.23) or, on a release that fixed it, keeps it."""
    import subprocess

    tree = _sglang_dumper_tree(tmp_path / "tree")

    def run(with_site):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(([T.TDUMP_SITE] if with_site else []) + [tree]))
        r = subprocess.run([sys.executable, "-c", _DUMPER_CHECK, str(tmp_path / ("s" if with_site else "n"))],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    out = run(True)
    assert "OK 3 [8.0, 0.0, 16.0]" in out and "PLAIN (2, 4)" in out
    stock = run(False)
    assert "FAILS" in stock or "OK" in stock
