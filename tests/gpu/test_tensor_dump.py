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
