"""Build the MoE testbed target from the dense base (runs on the GPU machine; CPU works, slowly).

  python3 build_moe.py --base /tmp/m/base --out /tmp/m/moe [--experts 128 --top-k 8] [--tail N] [--prompts DIR]

-> OUT/                Qwen2MoeForCausalLM (SGLang 0.5.17 serves it through the external model package
                       benchmarks/gpu/moe_models, which adds the get_embed_and_head that EAGLE-3 needs): every
                       expert of layer l is a copy of the dense model's MLP of layer l, the router of layer l a
                       fixed random matrix, no shared expert, top-k weights renormalised (norm_topk_prob). The
                       renormalised weights sum to 1, so the MoE block returns the dense MLP's output (up to bf16
                       rounding of the weighted sum) while each step reads the experts its tokens route to.
                       --tail N appends N dense layers (mlp_only_layers) after the 30 real ones: random q/k/v and
                       gate/up (real kernels, real KV), zero o_proj and down_proj, so they add exactly nothing to the
                       residual (the logits stay the base's; the draft's config pins the EAGLE-3 aux layers) and a
                       fixed cost to every step: the per-layer latency of a deeper model, which 30 layers at hidden
                       576 lack (docs/testbed.md, "The MoE target").
   OUT/moe.json        dims, sizes, and the experts-touched curve: per layer, the distinct experts a step of T
                       tokens selects, from the base model's real router inputs (the post-attention RMSNorm output
                       of every layer, captured on real prompts: the MoE's router input is the same up to bf16
                       rounding), for T tokens from T requests (no speculation) and from T/4 requests x 4
                       consecutive positions (a 4-token verify), beside the uniform-routing expectation and that
                       of DeepSeek-V3 (256 experts) and Kimi-K2 (384) at top-8.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_models import write_sharded  # noqa: E402

T0 = time.time()
TOKENS_PER_STEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def moe_config(base_cfg, experts, top_k, tail=0):
    """The Qwen2-MoE config of the base's shape. qkv_bias false: SGLang's Qwen2MoeAttention reads it (the base has
    none); an explicit lm_head (SGLang's Qwen2MoeForCausalLM always loads one); no shared expert. `tail` dense
    layers appended: mlp_only_layers (SGLang 0.5.17 makes every layer sparse; the testbed's model package reads
    it)."""
    c = base_cfg
    layers = c["num_hidden_layers"] + tail
    return {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": c["hidden_size"],
            "intermediate_size": c["intermediate_size"], "moe_intermediate_size": c["intermediate_size"],
            "shared_expert_intermediate_size": 0, "num_experts": experts, "num_experts_per_tok": top_k,
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(c["num_hidden_layers"], layers)), "num_hidden_layers": layers,
            "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c["num_key_value_heads"], "hidden_act": "silu",
            "max_position_embeddings": c["max_position_embeddings"], "rms_norm_eps": c["rms_norm_eps"],
            "rope_theta": c["rope_theta"], "rope_scaling": None, "qkv_bias": False, "tie_word_embeddings": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "vocab_size": c["vocab_size"], "bos_token_id": c.get("bos_token_id", 1),
            "eos_token_id": c.get("eos_token_id", 2), "pad_token_id": c.get("pad_token_id", 2),
            "torch_dtype": "bfloat16", "initializer_range": 0.02, "use_cache": True,
            "output_router_logits": False, "router_aux_loss_coef": 0.0}


def routers(layers, experts, hidden, seed, dev):
    """One fixed random router per layer (std 1/sqrt(hidden): logits of order one on RMS-normalised inputs)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(experts, hidden, generator=g, device=dev, dtype=torch.float32).div_(hidden ** 0.5)
            .to(torch.bfloat16) for _ in range(layers)]


def moe_tensors(sd, cfg, rts, seed=0):
    """The MoE checkpoint's tensors, generated layer by layer (experts are copies of the dense MLP; the tail's
    layers, cfg's mlp_only_layers, from tail_tensors)."""
    yield "model.embed_tokens.weight", sd["model.embed_tokens.weight"]
    yield "model.norm.weight", sd["model.norm.weight"]
    yield "lm_head.weight", sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    dense = set(cfg["mlp_only_layers"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if i in dense:
            yield from tail_tensors(p, sd, cfg, seed + i)
            continue
        for k in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj"):
            yield p + k + ".weight", sd[p + k + ".weight"]
        yield p + "mlp.gate.weight", rts[i]
        for e in range(len(rts[i])):
            for k in ("gate_proj", "up_proj", "down_proj"):
                yield f"{p}mlp.experts.{e}.{k}.weight", sd[p + "mlp." + k + ".weight"]


def tail_tensors(p, sd, cfg, seed):
    """One appended dense layer: norms of ones, random q/k/v and gate/up of the base's shapes (the kernels and the
    KV of a real layer), o_proj and down_proj zero, so that the layer adds exactly zero to the residual."""
    ref = "model.layers.0."
    g = torch.Generator(device=sd[ref + "self_attn.q_proj.weight"].device).manual_seed(seed)
    h = cfg["hidden_size"]
    yield p + "input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
    yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
    for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        w = sd[ref + k + ".weight"]
        yield p + k + ".weight", (torch.randn(w.shape, generator=g, device=w.device) * 0.02).to(torch.bfloat16)
    for k in ("self_attn.o_proj", "mlp.down_proj"):
        yield p + k + ".weight", torch.zeros_like(sd[ref + k + ".weight"], dtype=torch.bfloat16)


@torch.no_grad()
def router_inputs(base_dir, prompt_ids, dev, max_tokens=48000):
    """Per layer, the dense base's post-attention RMSNorm outputs (the MoE router's input) over real prompts:
    a list over prompts of [layers, positions, hidden] bf16 tensors."""
    from transformers import LlamaForCausalLM

    m = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).to(dev).eval()
    grabbed = []
    hooks = [layer.post_attention_layernorm.register_forward_hook(lambda _m, _i, o: grabbed.append(o[0]))
             for layer in m.model.layers]
    out, n = [], 0
    for ids in prompt_ids:
        grabbed.clear()
        m(torch.tensor([ids], device=dev))
        out.append(torch.stack(grabbed))  # [layers, positions, hidden]
        n += len(ids)
        if n >= max_tokens:
            break
    for h in hooks:
        h.remove()
    del m
    return out


def experts_touched(states, rts, top_k, draws, seed, width):
    """Mean over layers and draws of the distinct experts a step selects: T tokens = T / width requests, each
    `width` consecutive positions of its own prompt (width 1: one token per request; 4: a 4-token verify)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([s.shape[1] for s in states])
    curve = {}
    for t in TOKENS_PER_STEP:
        if t % width:
            continue
        reqs = t // width
        counts = []
        for _ in range(draws):
            pick = torch.randint(len(states), (reqs,), generator=g)  # requests may share a prompt at T > prompts
            rows = []
            for p in pick.tolist():
                start = int(torch.randint(max(1, int(lens[p]) - width + 1), (1,), generator=g))
                rows.append(states[p][:, start:start + width])
            x = torch.cat(rows, dim=1)  # [layers, t, hidden]
            for li, r in enumerate(rts):
                sel = torch.topk(x[li].float() @ r.float().T.to(x.device), top_k, dim=-1).indices
                counts.append(int(torch.unique(sel).numel()))
        curve[str(t)] = round(sum(counts) / len(counts), 2)
    return curve


def uniform_curve(experts, top_k):
    return {str(t): round(experts * (1 - (1 - top_k / experts) ** t), 2) for t in TOKENS_PER_STEP}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the dense base (build_models.py's OUT/base)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prompts", default="/tmp/specctl-stash/aux/prompts", help="MT-Bench + HumanEval (curve)")
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--tail", type=int, default=0, help="dense zero-output layers appended after the real ones: a "
                    "fixed per-step cost (the per-layer latency of a deeper model); the curve is the real layers'")
    ap.add_argument("--curve-only", action="store_true",
                    help="write OUT/moe.json (dims, sizes, the experts-touched curves) and no checkpoint: the curve "
                         "needs only the base's forward, which a CPU runs in minutes")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(a.base, "config.json")))
    sd = {k: v.to(dev) for k, v in load_file(os.path.join(a.base, "model.safetensors")).items()}
    mcfg = moe_config(cfg, a.experts, a.top_k, tail=a.tail)
    rts = routers(cfg["num_hidden_layers"], a.experts, cfg["hidden_size"], a.seed, dev)
    os.makedirs(a.out, exist_ok=True)
    t = time.time()
    if a.curve_only:
        # the tensors are the base's, not copies
        params = sum(v.numel() for _name, v in moe_tensors(sd, mcfg, rts, seed=a.seed))
    else:
        params = write_sharded(a.out, moe_tensors(sd, mcfg, rts, seed=a.seed))
        json.dump(mcfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
        for f in os.listdir(a.base):
            if f.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                with open(os.path.join(a.base, f), "rb") as src, open(os.path.join(a.out, f), "wb") as dst:
                    dst.write(src.read())
    per_expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    summ = {"path": None if a.curve_only else a.out, "experts": a.experts, "top_k": a.top_k, "layers": cfg["num_hidden_layers"],
            "tail_layers": a.tail, "moe_intermediate": cfg["intermediate_size"], "params": params,
            "expert_params": per_expert * a.experts * cfg["num_hidden_layers"],
            "active_expert_params_per_token": per_expert * a.top_k * cfg["num_hidden_layers"],
            "gb_bf16": round(params * 2 / 1e9, 2), "router_seed": a.seed, "build_s": round(time.time() - t, 1)}
    log(f"MoE: {params / 1e9:.2f}B params ({summ['gb_bf16']} GB bf16), E={a.experts}, top-{a.top_k}, "
        f"{summ['build_s']} s")
    try:
        import prompts as P
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.base)
        texts = [p["text"] for p in P.load_mtbench(os.path.join(a.prompts, "mtbench_question.jsonl"))]
        texts += [p["text"] for p in P.load_humaneval(os.path.join(a.prompts, "HumanEval.jsonl.gz"))]
        states = router_inputs(a.base, [P.chat_ids(tok, x) for x in texts], dev)
        summ["curve_method"] = (f"{len(states)} MT-Bench/HumanEval chat prompts through the dense base; per layer "
                                f"the post-attention RMSNorm outputs at random positions, routed by the MoE's routers; "
                                f"distinct experts per layer, mean over {len(rts)} layers x {a.draws} draws")
        summ["experts_touched"] = {
            "no_spec": experts_touched(states, rts, a.top_k, a.draws, 1, width=1),
            "verify_4": experts_touched(states, rts, a.top_k, a.draws, 2, width=4),
            "uniform": uniform_curve(a.experts, a.top_k),
            "deepseek_v3_uniform": uniform_curve(256, 8), "kimi_k2_uniform": uniform_curve(384, 8)}
        for k, v in summ["experts_touched"].items():
            log("experts touched", k, v)
    except Exception as e:  # the model stands without its curve; say why
        summ["experts_touched_error"] = f"{type(e).__name__}: {e}"
        log("no experts-touched curve:", summ["experts_touched_error"])
    json.dump(summ, open(os.path.join(a.out, "moe.json"), "w"), indent=1)
    log("MOE_SUMMARY", json.dumps({k: v for k, v in summ.items() if k != "experts_touched"}))


if __name__ == "__main__":
    main()
