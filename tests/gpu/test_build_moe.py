"""The MoE testbed target (benchmarks/gpu/build_moe.py): its config, its tensors, and the claim it rests on —
every expert a copy of the dense MLP, top-k weights renormalised, so the MoE block returns the dense MLP's
output whatever the router chooses. Needs torch (the sglang CPU environments have it: `make test` runs this
file there)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
try:
    import torch

    import build_moe as BM
except ImportError:  # the suite's interpreter: these tests are deselected there (marker below)
    torch = BM = None

# runs in the per-release passes, whose interpreters have torch
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(torch is None, reason="needs torch")]

BASE = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
        "vocab_size": 50}


def dense(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(50, 16, generator=g), "model.norm.weight": torch.ones(16)}
    for i in range(3):
        p = f"model.layers.{i}."
        for k, shape in (("input_layernorm", (16,)), ("post_attention_layernorm", (16,)),
                         ("self_attn.q_proj", (16, 16)), ("self_attn.k_proj", (8, 16)), ("self_attn.v_proj", (8, 16)),
                         ("self_attn.o_proj", (16, 16)), ("mlp.gate_proj", (24, 16)), ("mlp.up_proj", (24, 16)),
                         ("mlp.down_proj", (16, 24))):
            sd[p + k + ".weight"] = torch.randn(*shape, generator=g)
    return sd


def test_the_config_is_a_qwen2_moe_of_the_base_shape_sglang_serves_as_a_target():
    c = BM.moe_config(BASE, 128, 8)
    assert c["architectures"] == ["Qwen2MoeForCausalLM"] and c["model_type"] == "qwen2_moe"
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (128, 8, 24)
    # what makes the block the dense MLP: no shared expert, renormalised top-k, every layer sparse
    assert c["shared_expert_intermediate_size"] == 0 and c["norm_topk_prob"] is True
    assert c["decoder_sparse_step"] == 1 and c["mlp_only_layers"] == []
    # SGLang's Qwen2MoeAttention reads qkv_bias (the base has none); its model always loads an lm_head
    assert c["qkv_bias"] is False and c["tie_word_embeddings"] is False
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
              "rms_norm_eps", "rope_theta"):
        assert c[k] == BASE[k], k


def test_every_expert_is_the_dense_mlp_and_the_head_is_explicit():
    sd = dense()
    rts = BM.routers(3, 6, 16, seed=1, dev="cpu")
    out = dict(BM.moe_tensors(sd, BM.moe_config(BASE, 6, 2), rts))
    assert torch.equal(out["lm_head.weight"], sd["model.embed_tokens.weight"])  # tied base: the head written out
    for i in range(3):
        assert out[f"model.layers.{i}.mlp.gate.weight"].shape == (6, 16)
        for e in range(6):
            for k in ("gate_proj", "up_proj", "down_proj"):
                assert torch.equal(out[f"model.layers.{i}.mlp.experts.{e}.{k}.weight"], sd[f"model.layers.{i}.mlp.{k}.weight"])
    assert not any(k.startswith(tuple(f"model.layers.{i}.mlp.{k}" for i in range(3) for k in ("gate_proj", "up_proj")))
                   for k in out)  # no dense MLP left beside the experts


@pytest.mark.parametrize("experts,top_k", [(6, 2), (128, 8)])
def test_the_renormalised_moe_block_returns_the_dense_mlp(experts, top_k):
    """Qwen2-MoE's block as SGLang computes it (softmax over the router logits, top-k, weights renormalised,
    weighted sum of the chosen experts): with identical experts it is the dense MLP, in fp32 to rounding."""
    g = torch.Generator().manual_seed(3)
    wg, wu, wd = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(16, 24, generator=g)
    router = BM.routers(1, experts, 16, seed=4, dev="cpu")[0].float()
    x = torch.randn(37, 16, generator=g)

    def mlp(h):
        return (torch.nn.functional.silu(h @ wg.T) * (h @ wu.T)) @ wd.T

    p = torch.softmax(x @ router.T, dim=-1)
    w, idx = torch.topk(p, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    moe = sum(w[:, k:k + 1] * mlp(x) for k in range(top_k))  # every expert the same MLP
    assert torch.allclose(moe, mlp(x), rtol=1e-5, atol=1e-5)
    assert idx.unique().numel() > top_k  # the router does route: different tokens pick different experts


def test_uniform_curve_is_the_expected_distinct_experts():
    c = BM.uniform_curve(128, 8)
    assert c["1"] == 8.0 and c["512"] == pytest.approx(128.0, abs=0.01)
    assert all(a < b for a, b in zip(list(c.values()), list(c.values())[1:]) if b < 127.99)


def test_experts_touched_counts_distinct_experts_per_layer():
    g = torch.Generator().manual_seed(5)
    states = [torch.randn(2, 40, 16, generator=g) for _ in range(12)]  # [layers, positions, hidden] per prompt
    rts = BM.routers(2, 32, 16, seed=6, dev="cpu")
    one = BM.experts_touched(states, rts, 4, draws=3, seed=1, width=1)
    four = BM.experts_touched(states, rts, 4, draws=3, seed=1, width=4)
    assert one["1"] == 4.0  # one token: exactly top-k experts
    assert set(four) == {"4", "8", "16", "32", "64", "128", "256", "512"}  # T a multiple of the width only
    assert 4.0 <= four["4"] <= 16.0 and one["512"] <= 32.0 and one["64"] > one["4"]


def test_the_tail_is_dense_layers_that_add_nothing_to_the_residual():
    """--tail N: N layers after the real ones, listed in mlp_only_layers (the testbed's model package builds them
    dense), with the kernels of a real layer (random q/k/v, gate/up) and zero o_proj / down_proj: attention and
    MLP outputs are exactly zero, so the residual stream, and with it the logits, are the real layers'."""
    c = BM.moe_config(BASE, 6, 2, tail=2)
    assert c["num_hidden_layers"] == 5 and c["mlp_only_layers"] == [3, 4] and c["max_window_layers"] == 5
    sd = dense()
    out = dict(BM.moe_tensors(sd, c, BM.routers(3, 6, 16, seed=1, dev="cpu"), seed=7))
    for i in (3, 4):
        p = f"model.layers.{i}."
        assert not any(k.startswith(p + "mlp.experts") or k == p + "mlp.gate.weight" for k in out)
        for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"):
            assert out[p + k + ".weight"].shape == sd["model.layers.0." + k + ".weight"].shape, k
        for k in ("self_attn.o_proj", "mlp.down_proj"):
            assert not out[p + k + ".weight"].any(), k
        for k in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert out[p + k + ".weight"].float().abs().sum() > 0, k
        x = torch.randn(5, 16)
        gate, up = (x @ out[p + f"mlp.{k}.weight"].float().T for k in ("gate_proj", "up_proj"))
        up = torch.nn.functional.silu(gate) * up
        assert torch.equal(up @ out[p + "mlp.down_proj.weight"].float().T, torch.zeros(5, 16))
    # the two tail layers differ (seeded per layer) and the real layers are untouched
    assert not torch.equal(out["model.layers.3.self_attn.q_proj.weight"], out["model.layers.4.self_attn.q_proj.weight"])
    assert torch.equal(out["model.layers.2.mlp.experts.5.down_proj.weight"], sd["model.layers.2.mlp.down_proj.weight"])
    assert BM.moe_config(BASE, 6, 2)["mlp_only_layers"] == []  # no tail: every layer sparse, as before
