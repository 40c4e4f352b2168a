"""Offline acceptance of a saved EAGLE-3 draft against its target (GPU or CPU; no SGLang).

  python3 eval_draft.py --target /tmp/m/base --draft benchmarks/gpu/draft/v2 --prompts DIR [--limit 40]
        [--gen-tokens 256] [--dtype bfloat16|float32]

The target answers MT-Bench turn 1 / HumanEval greedily; a teacher-forced pass gives the aux states and
labels; the draft (loaded into train_draft.Eagle3Draft) is unrolled; prints tau(s) over every chain start
and tau_walk(s), the engine-like walk (chains start after each accepted run + bonus token).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prompts as P  # noqa: E402
import train_draft as T  # noqa: E402


def load_draft(ddir, target_model, cfg, dev, dtype):
    from safetensors.torch import load_file
    fn = os.path.join(ddir, "model.safetensors")
    w = load_file(fn if os.path.exists(fn) else os.path.join(ddir, "model-nohead.safetensors"))
    emb = target_model.model.embed_tokens.weight.detach()
    hot = (w["d2t"] + torch.arange(w["d2t"].numel())).to(dev)
    if "lm_head.weight" not in w:
        w["lm_head.weight"] = emb[hot.cpu() if emb.device.type == "cpu" else hot].cpu()
    d = T.Eagle3Draft(cfg["hidden_size"], w["midlayer.mlp.gate_proj.weight"].shape[0], cfg["num_attention_heads"],
                      cfg["num_key_value_heads"], hot.numel(), cfg["rms_norm_eps"], cfg["rope_theta"], emb.to(dtype))
    m = {"q_proj.weight": "midlayer.self_attn.q_proj.weight", "k_proj.weight": "midlayer.self_attn.k_proj.weight",
         "v_proj.weight": "midlayer.self_attn.v_proj.weight", "o_proj.weight": "midlayer.self_attn.o_proj.weight",
         "gate_proj.weight": "midlayer.mlp.gate_proj.weight", "up_proj.weight": "midlayer.mlp.up_proj.weight",
         "down_proj.weight": "midlayer.mlp.down_proj.weight", "input_layernorm": "midlayer.input_layernorm.weight",
         "hidden_norm": "midlayer.hidden_norm.weight", "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
         "norm": "norm.weight", "fc.weight": "fc.weight", "lm_head.weight": "lm_head.weight"}
    d.load_state_dict({k: w[v].float() for k, v in m.items()}, strict=True)
    return d.to(dev).to(dtype).eval(), hot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, a.dtype)
    from transformers import AutoTokenizer, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(a.target)
    cfg = json.load(open(os.path.join(a.target, "config.json")))
    model = LlamaForCausalLM.from_pretrained(a.target, dtype=dtype).to(dev).eval()
    draft, hot = load_draft(a.draft, model, cfg, dev, dtype)
    res = {"target": a.target, "draft": a.draft, "dtype": a.dtype, "gen_tokens": a.gen_tokens}
    sets = {"mtbench": P.load_mtbench(os.path.join(a.prompts, "mtbench_question.jsonl")),
            "humaneval": P.load_humaneval(os.path.join(a.prompts, "HumanEval.jsonl.gz"))}
    for name, items in sets.items():
        items = items[:a.limit] if a.limit else items
        for x in items:
            x["ids"] = T.chat_ids(tok, x["text"])
        ans = T.generate(model, items, tok, a.gen_tokens, a.bs, dev, 1e9)
        bts = T.featurize(model, ans, a.bs, dev)
        if dtype == torch.float32:
            for b in bts:
                b["aux"] = b["aux"].float()
        res[name] = T.evaluate(draft, bts, hot, walk=True)
        print(name, json.dumps(res[name]), flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
